# find_package(dtactor): the target dtactor::dtactor (libdtactor.so and the
# public headers dtactor/*.hpp). The headers include LibTorch's, so LibTorch
# (Debian: libtorch-dev, the version dtactor was built with) is found too.
include(CMakeFindDependencyMacro)
find_dependency(Torch)
include("${CMAKE_CURRENT_LIST_DIR}/dtactorTargets.cmake")
