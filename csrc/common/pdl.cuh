// Programmatic dependent launch (sm_90): a kernel launched with launch_pdl() may be scheduled
// while the previous kernel in the stream is still finishing; it must call pdl_wait() before its
// first global-memory access (the wait returns once the previous grid has completed and its
// writes are visible; it is a no-op for a plain launch). pdl_launch_dependents() lets the NEXT
// PDL-launched kernel (e.g. a w4a16_gemv whose weight prefetch does not depend on us) start
// launching before this grid ends; that kernel still waits for this grid before reading our
// outputs. In a CUDA graph the attribute becomes a programmatic edge. Why: a decode step is a
// chain of small kernels whose launch gaps (~1 µs each in a graph) are a visible share of it.
#pragma once
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

namespace atlas {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// cfg's launch (grid, block, shared memory, stream) in clusters of `cluster` CTAs along x (1: no
// cluster) with the programmatic-stream-serialization attribute; the same launch without that
// attribute where it is refused. cfg's own attributes are replaced. Returns the launch error.
template <typename Kernel, typename... Args>
cudaError_t launch_pdl(cudaLaunchConfig_t cfg, int cluster, Kernel kernel, Args&&... args) {
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[n].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = n + 1;
  if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return cudaGetLastError();
  (void)cudaGetLastError();                       // clear the refusal, launch in stream order
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// kernel<<<grid, block, smem, stream>>>(args...) in clusters of `cluster` CTAs along x, with
// programmatic dependent launch (see above).
template <typename... Params, typename... Args>
cudaError_t launch_pdl_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                               int cluster, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  return launch_pdl(cfg, cluster, kernel, static_cast<Args&&>(args)...);
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic dependent launch (no cluster).
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  return launch_pdl_cluster(kernel, grid, block, smem, stream, 1, static_cast<Args&&>(args)...);
}

// How many clusters of `cluster` CTAs (along x) of `kernel` — `threads` per CTA, `smem` bytes of
// dynamic shared memory — device `dev` holds at once (cudaOccupancyMaxActiveClusters; 0 where the
// query is refused, e.g. a non-portable size the kernel has not opted into). A host query, asked
// once per (kernel, dev, cluster, threads, smem) and cached; `grid` (a multiple of `cluster`) is
// the first caller's. Never called during stream work it would have to order against.
template <typename Kernel>
int max_active_clusters(Kernel kernel, int dev, int cluster, int threads, size_t smem, dim3 grid) {
  struct Entry { const void* fn; int dev, cluster, threads; size_t smem; int clusters; };
  static std::mutex mu;
  static std::vector<Entry> cache;
  const void* fn = reinterpret_cast<const void*>(kernel);
  std::lock_guard<std::mutex> lock(mu);
  for (const Entry& e : cache) {
    if (e.fn == fn && e.dev == dev && e.cluster == cluster && e.threads == threads && e.smem == smem) return e.clusters;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();                     // a refused query is not the next launch's error
    clusters = 0;
  }
  cache.push_back({fn, dev, cluster, threads, smem, clusters});
  return clusters;
}

}  // namespace atlas
