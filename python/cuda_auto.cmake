# Included before project() by the wheel build (pyproject.toml: CMAKE_PROJECT_INCLUDE_BEFORE).
# FLASHSERVE_CUDA=AUTO (the wheel's default) becomes ON when nvcc is found -- $CUDACXX, or
# nvcc on PATH, in $CUDA_HOME/bin, $CUDA_PATH/bin or /usr/local/cuda/bin -- and OFF otherwise.
# FLASHSERVE_CUDA=0/1 (environment, through pyproject.toml) decides explicitly.
include_guard(GLOBAL)

if(FLASHSERVE_CUDA STREQUAL "AUTO")
  if(DEFINED ENV{CUDACXX} AND EXISTS "$ENV{CUDACXX}")
    set(_flashserve_nvcc "$ENV{CUDACXX}")
  else()
    find_program(_flashserve_nvcc nvcc PATHS ENV CUDA_HOME ENV CUDA_PATH /usr/local/cuda PATH_SUFFIXES bin)
  endif()
  if(_flashserve_nvcc)
    set(FLASHSERVE_CUDA ON CACHE BOOL "Build the CUDA kernels (needs nvcc)" FORCE)
    set(CMAKE_CUDA_COMPILER "${_flashserve_nvcc}" CACHE FILEPATH "nvcc")
    message(STATUS "flashserve: nvcc found (${_flashserve_nvcc}): building the CUDA kernels")
  else()
    set(FLASHSERVE_CUDA OFF CACHE BOOL "Build the CUDA kernels (needs nvcc)" FORCE)
    message(STATUS "flashserve: no nvcc found: CPU-only build (set FLASHSERVE_CUDA=1 and CUDACXX to force)")
  endif()
endif()
