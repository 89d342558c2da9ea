// Float and integer atomics as sm_90 compiles them: the SASS of tests/data/sm90_atomics.sass,
// which tests/test_cuda_facts.py reads (.ci/cuda_facts.py must find the float ones, only);
// .ci/cuda_facts.py --control compiles this file with the build's flags and checks the same.
__global__ void global_unused(float* out, float v) { atomicAdd(out, v); }
__global__ void global_used(float* out, float v, float* r) { r[threadIdx.x] = atomicAdd(out, v); }
__global__ void shared_add(float* out, float v) {
  __shared__ float s;
  if (threadIdx.x == 0) s = 0;
  __syncthreads();
  atomicAdd(&s, v);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = s;
}
__global__ void double_unused(double* out, double v) { atomicAdd(out, v); }
__global__ void int_ok(unsigned* out, unsigned v) { atomicAdd(out, v); __shared__ unsigned s; atomicAdd(&s, v); __syncthreads(); out[1] = s; atomicMax((unsigned long long*)out + 2, 5ull); }
__global__ void s64(unsigned long long* out, unsigned long long v) {
  __shared__ unsigned long long s[4];
  if (threadIdx.x < 4) s[threadIdx.x] = 0;
  __syncthreads();
  atomicAdd(&s[0], v); atomicMax(&s[1], v); atomicMin(&s[2], v);
  atomicAdd((unsigned*)&s[3], (unsigned)v);
  __syncthreads();
  if (threadIdx.x < 4) out[threadIdx.x] = s[threadIdx.x];
}
