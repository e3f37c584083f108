# bench/configs.json is the one list of benchmark shapes. The Python
# benchmarks read it at run time; its "layer" and "small" lists become the
# header
# bench/bench_configs.h here for the C++ code that runs those shapes
# (mhc_gpu_bench, which so runs from a bundle without the data file, and
# the CUDA workspace test). Editing the JSON reruns CMake.
function(mhc_generate_bench_configs)
  set(json_file ${PROJECT_SOURCE_DIR}/bench/configs.json)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${json_file})
  file(READ ${json_file} json)
  # The layer list first, then the small one: kConfigs[0, kNumLayerConfigs)
  # are the layer configs.
  set(MHC_BENCH_LAYER_CONFIGS "")
  foreach(list layer small)
    string(JSON count LENGTH "${json}" ${list})
    if(list STREQUAL "layer")
      set(MHC_BENCH_NUM_LAYER_CONFIGS ${count})
    endif()
    math(EXPR last "${count} - 1")
    foreach(i RANGE ${last})
      string(JSON b GET "${json}" ${list} ${i} 0)
      string(JSON t GET "${json}" ${list} ${i} 1)
      string(JSON c GET "${json}" ${list} ${i} 2)
      string(APPEND MHC_BENCH_LAYER_CONFIGS "    {${b}, ${t}, ${c}},\n")
    endforeach()
  endforeach()
  configure_file(${PROJECT_SOURCE_DIR}/bench/bench_configs.h.in
    ${PROJECT_BINARY_DIR}/generated/bench/bench_configs.h @ONLY)
endfunction()

mhc_generate_bench_configs()
add_library(mhc_bench_configs INTERFACE)
target_include_directories(mhc_bench_configs INTERFACE
  ${PROJECT_BINARY_DIR}/generated)
