// The dtactor binary: the built-in models only. A program of your own
// registers its tasks first (dtactor/main.hpp, examples/custom_task/).
#include "dtactor/main.hpp"

int main(int argc, char** argv) { return dtactor::run_main(argc, argv); }
