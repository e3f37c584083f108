# `cmake --install`: the daemon and mhcctl (component runtime), and the C++
# client as a CMake package (component client): headers, static libraries
# and mhcConfig.cmake exporting mhc::client. The installed client is the RPC
# layer only; the helpers that need the kernels (mhc/client/tensor.h,
# spec.h, compare.h, shm.h) stay in the source tree.
include(CMakePackageConfigHelpers)

set(MHC_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/mhc)

install(TARGETS mhc_client_rpc mhc_proto mhc_health_proto
  EXPORT mhcTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT client
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT client
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES
    ${PROJECT_SOURCE_DIR}/client/cpp/include/mhc/client/client.h
    ${PROJECT_SOURCE_DIR}/client/cpp/include/mhc/client/compute_method.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/mhc/client COMPONENT client)
install(DIRECTORY ${PROJECT_BINARY_DIR}/proto/gen/mhc/v1/
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/mhc/v1 COMPONENT client
  FILES_MATCHING PATTERN "*.h")
install(DIRECTORY ${PROJECT_BINARY_DIR}/client/cpp/gen/grpc
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/mhc/health COMPONENT client
  FILES_MATCHING PATTERN "*.h")
install(EXPORT mhcTargets
  NAMESPACE mhc::
  DESTINATION ${MHC_CMAKE_DIR} COMPONENT client)

configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/mhcConfig.cmake.in
  ${PROJECT_BINARY_DIR}/mhcConfig.cmake
  INSTALL_DESTINATION ${MHC_CMAKE_DIR})
# 0.x: a minor release may change the API.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/mhcConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
    ${PROJECT_BINARY_DIR}/mhcConfig.cmake
    ${PROJECT_BINARY_DIR}/mhcConfigVersion.cmake
  DESTINATION ${MHC_CMAKE_DIR} COMPONENT client)
