# MHC_FUZZ=ON: a build tree for the libFuzzer harnesses of fuzz/, which
# calls mhc_fuzz_instrument on the targets they exercise. Generated protobuf
# code and Debian's gRPC, protobuf and abseil stay uninstrumented: the
# libraries are built with gcc against the same libstdc++ that clang uses,
# so they link as they are, and ASan needs no instrumentation of code it
# does not check.
if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "MHC_FUZZ=ON needs clang, which ships libFuzzer: "
                      "configure with CC=clang CXX=clang++")
endif()
if(NOT MHC_CUDA STREQUAL "OFF")
  message(FATAL_ERROR "MHC_FUZZ=ON needs -DMHC_CUDA=OFF: the harnesses run "
                      "on the reference backend")
endif()

# ASan and UBSan; UBSan findings abort (no recovery) so that libFuzzer sees
# them as crashes.
set(MHC_SANITIZE_FLAGS
  -fsanitize=address,undefined
  -fno-sanitize-recover=all
  -fno-omit-frame-pointer)

# Sanitizers and libFuzzer's coverage instrumentation on `targets`. -O1 -g:
# quick to build, fast enough to fuzz, readable stack traces; asserts stay
# on whatever the build type.
function(mhc_fuzz_instrument)
  foreach(target ${ARGN})
    target_compile_options(${target} PRIVATE
      ${MHC_SANITIZE_FLAGS} -fsanitize=fuzzer-no-link -O1 -g -UNDEBUG)
    target_link_options(${target} PRIVATE ${MHC_SANITIZE_FLAGS})
  endforeach()
endfunction()
