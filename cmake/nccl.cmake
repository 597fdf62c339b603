# NCCL for backend::NcclCommunicator (include/flashserve/nccl.hpp, src/nccl/), with
# FLASHSERVE_NCCL=ON in a CUDA build. Searched in order: NCCL_ROOT / $NCCL_ROOT / $NCCL_HOME,
# the CUDA toolkit, the system paths, and the nvidia-nccl-cu* pip wheel that torch installs
# (site-packages/nvidia/nccl/{include,lib}; its library is libnccl.so.2, without the
# unversioned link). Not found: a warning, and the build goes on without the communicator
# (FLASHSERVE_WITH_NCCL=0).
set(_fs_nccl_hints)
foreach(_v NCCL_ROOT NCCL_HOME)
  if(DEFINED ${_v})
    list(APPEND _fs_nccl_hints ${${_v}})
  endif()
  if(DEFINED ENV{${_v}})
    list(APPEND _fs_nccl_hints $ENV{${_v}})
  endif()
endforeach()
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _fs_nccl_hints ${CUDAToolkit_LIBRARY_ROOT})
endif()
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
    OUTPUT_VARIABLE _fs_nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_fs_nccl_wheel)
    list(APPEND _fs_nccl_hints ${_fs_nccl_wheel})
  endif()
endif()

find_path(FLASHSERVE_NCCL_INCLUDE_DIR nccl.h HINTS ${_fs_nccl_hints} PATH_SUFFIXES include)
find_library(FLASHSERVE_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_fs_nccl_hints} PATH_SUFFIXES lib lib64)

if(FLASHSERVE_NCCL_INCLUDE_DIR AND FLASHSERVE_NCCL_LIBRARY)
  target_sources(flashserve PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/nccl/nccl_comm.cpp)
  target_include_directories(flashserve PRIVATE ${FLASHSERVE_NCCL_INCLUDE_DIR})
  target_link_libraries(flashserve PUBLIC ${FLASHSERVE_NCCL_LIBRARY})
  target_compile_definitions(flashserve PUBLIC FLASHSERVE_WITH_NCCL=1)
  set(FLASHSERVE_WITH_NCCL ON)
  message(STATUS "flashserve: NCCL ${FLASHSERVE_NCCL_LIBRARY} (headers ${FLASHSERVE_NCCL_INCLUDE_DIR})")
else()
  target_compile_definitions(flashserve PUBLIC FLASHSERVE_WITH_NCCL=0)
  set(FLASHSERVE_WITH_NCCL OFF)
  message(WARNING "flashserve: FLASHSERVE_NCCL=ON but NCCL was not found (set NCCL_ROOT, or pip install "
                  "nvidia-nccl-cu13): building without backend::NcclCommunicator")
endif()
