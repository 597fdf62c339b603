# ctest's install_consumer: cmake --install the build tree (component dev) into a fresh
# prefix, then configure, build and run examples/consumer against it with find_package, as a
# C++ engine outside the tree would.
#   cmake -DBUILD_DIR=<build> -DSOURCE_DIR=<repo> -DWORK_DIR=<scratch> [-DCUDACXX=...] -P consumer_test.cmake
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR)
  if(NOT ${var})
    message(FATAL_ERROR "consumer_test: ${var} is not set")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "consumer_test: '${cmd}' failed (${rc})")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --component dev)
foreach(f include/flashserve/attention.hpp lib/cmake/flashserve/flashserveConfig.cmake)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "consumer_test: ${prefix}/${f} was not installed")
  endif()
endforeach()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/consumer -B ${WORK_DIR}/build -G Ninja
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
