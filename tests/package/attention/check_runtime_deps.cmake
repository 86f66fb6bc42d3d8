# cmake -DEXE=<program> -P check_runtime_deps.cmake: fails if the program, or any shared library
# it loads, depends on a BLAS (OpenBLAS) library.
file(GET_RUNTIME_DEPENDENCIES EXECUTABLES ${EXE}
  RESOLVED_DEPENDENCIES_VAR resolved UNRESOLVED_DEPENDENCIES_VAR unresolved)
message(STATUS "${EXE} loads: ${resolved} ${unresolved}")
foreach(lib IN LISTS resolved unresolved)
  get_filename_component(name ${lib} NAME)
  if(name MATCHES "blas|lapack")
    message(FATAL_ERROR "${EXE} depends on ${lib}; qkv::attention must not need a BLAS")
  endif()
endforeach()
