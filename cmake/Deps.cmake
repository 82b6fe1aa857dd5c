# The C++ libraries: Debian's packages (find_package), or, on a machine that cannot install them (the
# lent GPU machines reach no package archive), the copies scripts/pack-deps.sh gathers into one folder:
# -DLOSSGUARD_DEPS_DIR=<folder>. There fmt, nlohmann-json and CLI11 are used header-only and searched
# after the system headers (-idirafter, where /usr/include would be, so LibTorch's own fmt keeps winning
# in its translation units), and GoogleTest is built from its sources.
set(LOSSGUARD_DEPS_DIR "" CACHE PATH "Folder from scripts/pack-deps.sh, instead of the Debian packages")
find_package(Threads REQUIRED)
if(NOT LOSSGUARD_DEPS_DIR)
  find_package(fmt REQUIRED)
  find_package(nlohmann_json 3.10 REQUIRED)
  find_package(CLI11 REQUIRED)
  find_package(GTest REQUIRED)
  return()
endif()
message(STATUS "lossguard: C++ libraries from ${LOSSGUARD_DEPS_DIR}")
add_library(lossguard_deps_headers INTERFACE)
# (CUDA translation units have no LibTorch: a plain -isystem there)
target_compile_options(lossguard_deps_headers INTERFACE "$<$<COMPILE_LANGUAGE:CXX>:SHELL:-idirafter ${LOSSGUARD_DEPS_DIR}/include>"
                       "$<$<COMPILE_LANGUAGE:CUDA>:SHELL:-isystem ${LOSSGUARD_DEPS_DIR}/include>")
add_library(fmt::fmt INTERFACE IMPORTED)
target_link_libraries(fmt::fmt INTERFACE lossguard_deps_headers)
target_compile_definitions(fmt::fmt INTERFACE $<$<COMPILE_LANGUAGE:CXX,CUDA>:FMT_HEADER_ONLY=1>)
add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
target_link_libraries(nlohmann_json::nlohmann_json INTERFACE lossguard_deps_headers)
add_library(CLI11::CLI11 INTERFACE IMPORTED)
target_link_libraries(CLI11::CLI11 INTERFACE lossguard_deps_headers)
set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
add_subdirectory(${LOSSGUARD_DEPS_DIR}/googletest ${CMAKE_BINARY_DIR}/googletest EXCLUDE_FROM_ALL)
if(NOT TARGET GTest::gtest_main)  # newer GoogleTest releases define the namespaced names themselves
  add_library(GTest::gtest ALIAS gtest)
  add_library(GTest::gtest_main ALIAS gtest_main)
endif()
