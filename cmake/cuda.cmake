# The CUDA part of the flashserve library (included when FLASHSERVE_CUDA is ON).
# Kernels live under src/kernels/ (every .cu there is compiled into the library); host code
# sees them through plain C++ headers next to them.

option(FLASHSERVE_DEV_CONFIGS
  "Instantiate a restricted kernel set (development builds: faster to compile)" OFF)

# 90a: the Hopper fast path (wgmma, TMA); 80: the portable sm80+ kernels. Set before the
# language is enabled, or CMake probes for a default; the library target already exists, so
# it gets the property directly too.
set(CMAKE_CUDA_ARCHITECTURES ${FLASHSERVE_CUDA_ARCHS})
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# CUDA C++20. CMake 3.25 knows no nvcc flag for the CUDA20 dialect (later versions do), and
# the CUDA dialect follows CXX_STANDARD unless CUDA_STANDARD is set: supply the flag.
if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set_target_properties(flashserve PROPERTIES
  CUDA_ARCHITECTURES "${FLASHSERVE_CUDA_ARCHS}"
  CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)

file(GLOB_RECURSE FLASHSERVE_CUDA_SOURCES CONFIGURE_DEPENDS
  ${CMAKE_CURRENT_SOURCE_DIR}/src/kernels/*.cu)
target_sources(flashserve PRIVATE ${FLASHSERVE_CUDA_SOURCES})

target_compile_options(flashserve PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
target_link_libraries(flashserve PUBLIC CUDA::cudart)
# Public: tests that include the instantiation tables must see the same set as the library.
# FLASHSERVE_SM90A: the build has sm_90a code, so the selection may pick the wgmma kernels.
if("90a" IN_LIST FLASHSERVE_CUDA_ARCHS)
  set(_fs_sm90a 1)
else()
  set(_fs_sm90a 0)
endif()
target_compile_definitions(flashserve PUBLIC
  FLASHSERVE_WITH_CUDA=1 FLASHSERVE_DEV_CONFIGS=$<BOOL:${FLASHSERVE_DEV_CONFIGS}> FLASHSERVE_SM90A=${_fs_sm90a})

list(LENGTH FLASHSERVE_CUDA_SOURCES _fs_num_cu)
message(STATUS "flashserve: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES}, "
               "${_fs_num_cu} kernel sources, dev configs ${FLASHSERVE_DEV_CONFIGS}")
