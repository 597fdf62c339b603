# cmake --install: the C++ library as engines consume it.
#   <prefix>/include/flashserve/*.hpp          the public API (no CUDA or torch headers)
#   <prefix>/lib/libflashserve.a               host code, and the kernels in a CUDA build
#   <prefix>/lib/cmake/flashserve/             flashserveConfig.cmake, version, targets
# A consumer writes find_package(flashserve REQUIRED) and links flashserve::flashserve
# (examples/consumer is one, built and run by the test install_consumer).
# Everything here is the install component "dev"; the Python extension is "python", so that
# pip install . (scikit-build-core installs only that component) ships no headers or archive.
include(CMakePackageConfigHelpers)

set(FLASHSERVE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/flashserve)
install(TARGETS flashserve EXPORT flashserveTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/flashserve
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev)
install(EXPORT flashserveTargets NAMESPACE flashserve::
  DESTINATION ${FLASHSERVE_CMAKE_DIR} COMPONENT dev)

# The config re-finds what the static library's link interface names (OpenMP, Threads, and
# CUDA's runtime in a CUDA build) and records the build's features for the consumer.
set(FLASHSERVE_INSTALLED_WITH_CUDA ${FLASHSERVE_CUDA})
set(FLASHSERVE_INSTALLED_WITH_NCCL ${FLASHSERVE_WITH_NCCL})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/flashserveConfig.cmake.in
  ${PROJECT_BINARY_DIR}/flashserveConfig.cmake INSTALL_DESTINATION ${FLASHSERVE_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/flashserveConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/flashserveConfig.cmake ${PROJECT_BINARY_DIR}/flashserveConfigVersion.cmake
  DESTINATION ${FLASHSERVE_CMAKE_DIR} COMPONENT dev)
