#!/bin/bash
# session 35 call 1: l2_prefetch op + MtpHead's forked LM-head prefetch: build, tests (l2_prefetch,
# mtp), memcheck of the l2_prefetch tests, bench_mtp --prefetch sweep.
cd "$(dirname "$0")/.."
mkdir -p $OUT /tmp/o; t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
python3 -m pip install -v -e . --no-build-isolation --no-deps > /tmp/o/build.log 2>&1; el "build rc=$?"
tail -3 /tmp/o/build.log
timeout 150 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_l2_prefetch.py tests/test_mtp.py -x > /tmp/o/tests.log 2>&1; el "tests rc=$?"
tail -5 /tmp/o/tests.log
timeout 100 compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 10 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_l2_prefetch.py tests/test_mtp.py -k prefetch > /tmp/o/memcheck.log 2>&1; el "memcheck rc=$?"
grep -E "ERROR SUMMARY|passed|failed" /tmp/o/memcheck.log | tail -2
timeout 240 python3 bench/bench_mtp.py --prefetch > /tmp/o/prefetch.log 2>&1; el "prefetch rc=$?"
cat /tmp/o/prefetch.log | grep -v Warn
cp bench/results/bench_mtp_prefetch.* /tmp/o/ 2>/dev/null
tar -czf $OUT/logs.tgz -C /tmp/o .
