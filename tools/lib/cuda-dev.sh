# Sourced by the GPU-machine tools (gpu-bench, gpu-ab, gpu-ncu), from the repository root.

# nvcc from /usr/local/cuda when it is not on PATH (the GPU image's layout).
use_cuda_toolkit() {
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  fi
}

# build_cuda_dev <configure log> <build log> <target...>: configures build/cuda-dev when it is
# not (tests on; without tests and examples if GoogleTest is missing), then builds the targets.
# Non-zero when either step fails (the logs say why).
build_cuda_dev() {
  local configure_log=$1 build_log=$2
  shift 2
  if [ ! -f build/cuda-dev/build.ninja ]; then
    cmake --preset cuda-dev >"$configure_log" 2>&1 ||
      cmake --preset cuda-dev -DFLASHSERVE_TESTS=OFF -DFLASHSERVE_EXAMPLES=OFF >>"$configure_log" 2>&1 ||
      return 1
  fi
  cmake --build build/cuda-dev -j "$(nproc)" --target "$@" >"$build_log" 2>&1
}
