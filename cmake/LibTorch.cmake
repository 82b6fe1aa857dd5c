# LibTorch from the PyPI `torch` wheel. The wheel is a CUDA build whose TorchConfig.cmake wants to
# configure CUDA; lossguard only needs the CPU libraries (torch_cpu, c10), so it links them directly
# with the wheel's include directories. LOSSGUARD_TORCH_DIR overrides the location (for example a
# LibTorch zip, or Debian's libtorch-dev under /usr).
if(NOT LOSSGUARD_TORCH_DIR)
  execute_process(
    COMMAND ${LOSSGUARD_PYTHON} -c "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch.compiled_with_cxx11_abi())); print(torch.__version__)"
    OUTPUT_VARIABLE _torch_out RESULT_VARIABLE _torch_rc OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _torch_rc EQUAL 0)
    message(FATAL_ERROR "lossguard needs LibTorch: `${LOSSGUARD_PYTHON} -c 'import torch'` failed. "
                        "Run scripts/setup.sh, or pass -DLOSSGUARD_PYTHON=<python with torch> or -DLOSSGUARD_TORCH_DIR=<libtorch>.")
  endif()
  string(REPLACE "\n" ";" _torch_out "${_torch_out}")
  list(GET _torch_out 0 LOSSGUARD_TORCH_DIR)
  list(GET _torch_out 1 LOSSGUARD_TORCH_CXX11_ABI)
  list(GET _torch_out 2 LOSSGUARD_TORCH_VERSION)
else()
  set(LOSSGUARD_TORCH_CXX11_ABI 1 CACHE STRING "Value of _GLIBCXX_USE_CXX11_ABI LibTorch was built with")
  set(LOSSGUARD_TORCH_VERSION "unknown")
endif()
find_library(LOSSGUARD_TORCH_CPU_LIB torch_cpu PATHS ${LOSSGUARD_TORCH_DIR}/lib NO_DEFAULT_PATH REQUIRED)
find_library(LOSSGUARD_C10_LIB c10 PATHS ${LOSSGUARD_TORCH_DIR}/lib NO_DEFAULT_PATH REQUIRED)
add_library(lossguard_libtorch INTERFACE)
target_include_directories(lossguard_libtorch SYSTEM INTERFACE
  ${LOSSGUARD_TORCH_DIR}/include ${LOSSGUARD_TORCH_DIR}/include/torch/csrc/api/include)
# The wheel ships its own (newer) fmt headers, which shadow the system fmt in these translation units;
# they use it header-only, in its own inline namespace, so the two never meet at link time.
target_compile_definitions(lossguard_libtorch INTERFACE _GLIBCXX_USE_CXX11_ABI=${LOSSGUARD_TORCH_CXX11_ABI} FMT_HEADER_ONLY=1)
target_link_libraries(lossguard_libtorch INTERFACE ${LOSSGUARD_TORCH_CPU_LIB} ${LOSSGUARD_C10_LIB})
set(CMAKE_BUILD_RPATH "${LOSSGUARD_TORCH_DIR}/lib")
set(CMAKE_INSTALL_RPATH "${LOSSGUARD_TORCH_DIR}/lib")
get_filename_component(LOSSGUARD_TORCH_BIN_DIR "${LOSSGUARD_PYTHON}" DIRECTORY)
message(STATUS "lossguard: LibTorch ${LOSSGUARD_TORCH_VERSION} from ${LOSSGUARD_TORCH_DIR}")
