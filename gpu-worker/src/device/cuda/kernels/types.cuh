// Duet CUDA kernels: the integer types and the ggml type ids, shared by every kernel file and
// by the host-C++ check of the block decoding (gpu-worker/tests/cuda_units_on_host.rs).

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32

// ggml type ids (ggml.h), as the GGUF file stores them.
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_BF16 30
