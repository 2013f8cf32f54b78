// The kernels' vector width in float lanes (decode.cpp, store.cpp): 16 with AVX-512, else 8. gcc lowers a generic
// vector wider than the CPU's through the stack (30x slower on an AVX2 CPU: docs/VLLM.md), so the loops work in
// KVARN_VW lanes; sums whose order depends on the lane count keep the order of 16. -DKVARN_VW=8 or 16 builds the
// other width (tests/kernels/test_cpu_decode.py checks that both give the same bits).
#pragma once

#ifndef KVARN_VW
#if defined(__AVX512F__)
#define KVARN_VW 16
#else
#define KVARN_VW 8
#endif
#endif
static_assert(KVARN_VW == 8 || KVARN_VW == 16, "KVARN_VW: 8 or 16 float lanes");
