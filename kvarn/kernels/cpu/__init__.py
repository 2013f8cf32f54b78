"""The C++/OpenMP CPU kernels (decode.cpp), built on first use by `build.load`."""
