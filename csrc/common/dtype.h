// Element types as launchers see them (no torch headers in kernel .cu files).
#pragma once

namespace atlas {
enum class DType : int { kBF16 = 0, kF16 = 1, kF32 = 2, kE4M3 = 3 };
}  // namespace atlas
