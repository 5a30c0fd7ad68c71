// All-to-all over CUDA IPC peer buffers, for the sequence-parallel token/head exchange.
//
// Every rank owns one device allocation, exported once with cudaIpcGetMemHandle and opened by every
// peer: a flag area followed by the receive buffer. One kernel launch per exchange pushes this
// rank's chunk for peer p straight into p's receive buffer, already in the final (gathered) layout,
// so the receiver only has to copy its buffer out. Ranks meet twice per launch through flags in peer
// memory (system scope): before writing (the receiver has finished reading the previous exchange)
// and after writing (all data has landed). Every wait has a deadline read from the global timer;
// a rank that misses it records which peer was missing and returns instead of hanging.
//
// This file must never depend on torch headers: it is a plain C ABI opened with ctypes, so that it
// builds in seconds and survives torch ABI changes. It never allocates anything but its own buffers.

#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 128;
constexpr int kThreads = 512;
constexpr int kUnroll = 8;
// One warp copies one segment: a piece of a run (a stretch contiguous on both sides) of at most
// kSegmentUnits units, each lane holding kUnroll loads in flight before it stores.
constexpr uint64_t kSegmentUnits = 32 * kUnroll;
// Blocks are sized from the message (never from the device or the alignment) because block b of
// every rank pairs with block b of its peers through the flags: all ranks must launch the same grid.
constexpr uint64_t kBytesPerBlock = 256 * 1024;
constexpr int kStartPhase = 0;
constexpr int kEndPhase = 1;
// Flags: [phase][block][sender] uint64 epochs, then the receive buffer (256-byte aligned).
constexpr size_t kFlagBytes = 2 * kMaxBlocks * kMaxRanks * sizeof(uint64_t);
constexpr size_t kDataOffset = (kFlagBytes + 255) / 256 * 256;

struct Exchange {
  const char* src;               // this rank's input, contiguous, viewed as [outer, world, inner]
  char* bases[kMaxRanks];        // every rank's IPC allocation (flags, then receive buffer)
  int rank;
  int world;
  uint64_t epoch;                // the same on every rank: how many exchanges this group has run
  uint64_t inner_units;          // row length of the input, per chunk
  uint64_t gather_inner_units;   // row length of the output, per source rank
  uint64_t run_units;            // gcd of both: a stretch contiguous in input and output
  uint64_t runs;                 // runs per chunk
  uint64_t segments_per_run;
  uint64_t timeout_ns;
  volatile int* status;          // host-mapped: 0, or (phase + 1) * 256 + missing peer + 1
};

__device__ __forceinline__ uint64_t* flag_slot(char* base, int phase, int block, int sender) {
  return reinterpret_cast<uint64_t*>(base) + (static_cast<size_t>(phase) * kMaxBlocks + block) * kMaxRanks + sender;
}

__device__ __forceinline__ void store_release_system(uint64_t* address, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_system(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Block b tells block b of every peer that it reached `phase` of this epoch, then waits until block
// b of every peer has told it the same. Returns false (for the whole block) when a peer missed the
// deadline. Thread p < world handles peer p.
__device__ bool meet_peers(const Exchange& x, int phase, uint64_t deadline, int* block_failed) {
  __syncthreads();
  const int peer = threadIdx.x;
  if (peer < x.world) {
    // Makes this block's pushes into peer memory visible before the flag that announces them
    // (cumulative over the block thanks to the barrier above).
    __threadfence_system();
    store_release_system(flag_slot(x.bases[peer], phase, blockIdx.x, x.rank), x.epoch);
    const uint64_t* mine = flag_slot(x.bases[x.rank], phase, blockIdx.x, peer);
    uint32_t spins = 0;
    // >=: a fast peer may already be one epoch further along in the other phase's slots only,
    // never in these, so the slot holds either an older epoch or exactly this one.
    while (load_acquire_system(mine) < x.epoch) {
      if ((++spins & 255u) == 0 && global_timer_ns() > deadline) {
        *x.status = (phase + 1) * 256 + peer + 1;
        atomicExch(block_failed, 1);
        break;
      }
    }
  }
  __syncthreads();
  return *block_failed == 0;
}

template <typename Unit>
__device__ void push_chunks(const Exchange& x) {
  const int lane = threadIdx.x & 31;
  const uint64_t warps_per_block = kThreads / 32;
  const uint64_t first_warp = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const uint64_t warps = gridDim.x * warps_per_block;
  const uint64_t items = static_cast<uint64_t>(x.world) * x.runs * x.segments_per_run;
  const Unit* src = reinterpret_cast<const Unit*>(x.src);
  // Consecutive items go to different peers so that every link is busy at once.
  for (uint64_t item = first_warp; item < items; item += warps) {
    const int peer = static_cast<int>(item % x.world);
    const uint64_t segment = item / x.world;
    const uint64_t run = segment / x.segments_per_run;
    const uint64_t offset_in_run = (segment % x.segments_per_run) * kSegmentUnits;
    const uint64_t length = min(kSegmentUnits, x.run_units - offset_in_run);
    const uint64_t flat = run * x.run_units + offset_in_run;  // position inside the chunk
    const uint64_t from = (flat / x.inner_units) * x.world * x.inner_units + peer * x.inner_units + flat % x.inner_units;
    const uint64_t to = (flat / x.gather_inner_units) * x.world * x.gather_inner_units +
                        static_cast<uint64_t>(x.rank) * x.gather_inner_units + flat % x.gather_inner_units;
    const Unit* source = src + from;
    Unit* target = reinterpret_cast<Unit*>(x.bases[peer] + kDataOffset) + to;
    Unit values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = u * 32 + lane;
      if (i < length) values[u] = __ldg(source + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = u * 32 + lane;
      if (i < length) target[i] = values[u];
    }
  }
}

template <typename Unit>
__global__ void __launch_bounds__(kThreads) ipc_all_to_all_kernel(const __grid_constant__ Exchange x) {
  __shared__ int block_failed;
  if (threadIdx.x == 0) block_failed = 0;
  const uint64_t deadline = global_timer_ns() + x.timeout_ns;
  // Start: every peer's previous copy-out is done (it runs on the peer's stream before this launch).
  if (!meet_peers(x, kStartPhase, deadline, &block_failed)) return;
  push_chunks<Unit>(x);
  // End: block b of every peer has landed its part; the whole launch ending means all of it has.
  meet_peers(x, kEndPhase, deadline, &block_failed);
}

template <typename Unit>
cudaError_t launch_with_unit(Exchange x, int blocks, cudaStream_t stream) {
  ipc_all_to_all_kernel<Unit><<<blocks, kThreads, 0, stream>>>(x);
  return cudaGetLastError();
}

uint64_t gcd(uint64_t a, uint64_t b) {
  while (b) {
    const uint64_t r = a % b;
    a = b;
    b = r;
  }
  return a;
}

// Runs `call` on `device` and puts the caller's current device back: torch keeps its own idea of
// the current device on this thread and must not find it changed.
template <typename Call>
int on_device(int device, Call call) {
  int previous = -1;
  cudaError_t status = cudaGetDevice(&previous);
  if (status != cudaSuccess) return status;
  if (previous != device && (status = cudaSetDevice(device)) != cudaSuccess) return status;
  status = call();
  if (previous != device) cudaSetDevice(previous);
  return status;
}

}  // namespace

extern "C" {

int mgpu_a2a_abi_version() { return 1; }
int mgpu_a2a_max_ranks() { return kMaxRanks; }
const char* mgpu_a2a_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// Allocates flags + `data_bytes` of receive buffer, zeroes it (epochs start at 0) and exports it.
int mgpu_a2a_allocate(int device, unsigned long long data_bytes, void** base, unsigned char* handle_out) {
  return on_device(device, [&]() -> cudaError_t {
    cudaError_t status = cudaMalloc(base, kDataOffset + data_bytes);
    if (status != cudaSuccess) return status;
    // Synchronous on purpose: a peer may write flags as soon as it has the handle.
    if ((status = cudaMemset(*base, 0, kFlagBytes)) != cudaSuccess) return status;
    if ((status = cudaDeviceSynchronize()) != cudaSuccess) return status;
    cudaIpcMemHandle_t handle;
    if ((status = cudaIpcGetMemHandle(&handle, *base)) != cudaSuccess) return status;
    for (int i = 0; i < static_cast<int>(sizeof(handle)); ++i) handle_out[i] = handle.reserved[i];
    return cudaSuccess;
  });
}

int mgpu_a2a_free(int device, void* base) {
  return on_device(device, [&]() { return cudaFree(base); });
}

int mgpu_a2a_open(int device, const unsigned char* handle_in, void** base) {
  return on_device(device, [&]() {
    cudaIpcMemHandle_t handle;
    for (int i = 0; i < static_cast<int>(sizeof(handle)); ++i) handle.reserved[i] = handle_in[i];
    return cudaIpcOpenMemHandle(base, handle, cudaIpcMemLazyEnablePeerAccess);
  });
}

int mgpu_a2a_close(int device, void* base) {
  return on_device(device, [&]() { return cudaIpcCloseMemHandle(base); });
}

// A host word the kernel can write (mapped pinned memory), so a timeout is readable after a sync.
int mgpu_a2a_allocate_status(int device, int** host, int** device_view) {
  return on_device(device, [&]() {
    cudaError_t status = cudaHostAlloc(reinterpret_cast<void**>(host), sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
    if (status != cudaSuccess) return status;
    **host = 0;
    return cudaHostGetDevicePointer(reinterpret_cast<void**>(device_view), *host, 0);
  });
}

int mgpu_a2a_free_status(int* host) { return cudaFreeHost(host); }

// One exchange. `bases` holds `world` allocation bases (this rank's own at index `rank`); the byte
// sizes describe the input as [outer, world, inner_bytes] and the output as [outer', world,
// gather_inner_bytes]; `src` must be 16-byte aligned.
int mgpu_a2a_launch(int device, void* stream, const void* src, const unsigned long long* bases, int rank, int world,
                    unsigned long long epoch, unsigned long long inner_bytes, unsigned long long gather_inner_bytes,
                    unsigned long long chunk_bytes, unsigned long long timeout_ns, int* status_device) {
  if (world < 1 || world > kMaxRanks || rank < 0 || rank >= world) return cudaErrorInvalidValue;
  if (inner_bytes == 0 || gather_inner_bytes == 0 || chunk_bytes == 0) return cudaErrorInvalidValue;
  Exchange x{};
  x.src = static_cast<const char*>(src);
  for (int r = 0; r < world; ++r) x.bases[r] = reinterpret_cast<char*>(bases[r]);
  x.rank = rank;
  x.world = world;
  x.epoch = epoch;
  x.timeout_ns = timeout_ns;
  x.status = status_device;
  const uint64_t run_bytes = gcd(inner_bytes, gather_inner_bytes);
  uint64_t unit = 16;
  while (unit > 1 && (run_bytes % unit != 0 || reinterpret_cast<uintptr_t>(src) % unit != 0)) unit /= 2;
  x.inner_units = inner_bytes / unit;
  x.gather_inner_units = gather_inner_bytes / unit;
  x.run_units = run_bytes / unit;
  x.runs = chunk_bytes / run_bytes;
  x.segments_per_run = (x.run_units + kSegmentUnits - 1) / kSegmentUnits;
  const uint64_t wanted_blocks = (static_cast<uint64_t>(world) * chunk_bytes + kBytesPerBlock - 1) / kBytesPerBlock;
  const int blocks = static_cast<int>(wanted_blocks < kMaxBlocks ? (wanted_blocks > 0 ? wanted_blocks : 1) : kMaxBlocks);
  const cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  return on_device(device, [&]() {
    switch (unit) {
      case 16: return launch_with_unit<uint4>(x, blocks, cuda_stream);
      case 8: return launch_with_unit<uint2>(x, blocks, cuda_stream);
      case 4: return launch_with_unit<uint32_t>(x, blocks, cuda_stream);
      case 2: return launch_with_unit<uint16_t>(x, blocks, cuda_stream);
      default: return launch_with_unit<uint8_t>(x, blocks, cuda_stream);
    }
  });
}

// Copies this rank's received exchange (`bytes` from the start of its receive buffer) into `dst`,
// on the stream of the launch, so that the buffer is free again before the next launch starts.
int mgpu_a2a_copy_out(int device, void* stream, void* dst, void* base, unsigned long long bytes) {
  return on_device(device, [&]() {
    return cudaMemcpyAsync(dst, static_cast<char*>(base) + kDataOffset, bytes, cudaMemcpyDeviceToDevice,
                           static_cast<cudaStream_t>(stream));
  });
}

}  // extern "C"
