// Page gather / scatter for the lmc-server CUDA transfer engine.
//
// A descriptor is three 64-bit words: {page address, object address, bytes}. The page
// address points into a worker's KV buffer (mapped through CUDA IPC), the object
// address into a contiguous object: a GPU staging buffer (copy mode "staging") or the
// mapped pinned host pool (copy mode "mapped"). Every address was range-checked on the
// host before launch (lmc_server.transfer.cuda_plan).
//
//   gather_pages:  page   -> object   (store: engine pages into an object)
//   scatter_pages: object -> page     (retrieve: an object back into engine pages)
//
// Thread block b handles descriptors b, b + gridDim.x, ...; its threads split one
// descriptor's bytes. 16-byte vector loads/stores when both addresses and the length
// are 16-byte aligned (every DeepSeek-V4.1 page is: 19008, 16896 and 4224 bytes),
// 8- and 4-byte words when that is the widest common alignment, bytes otherwise.
// The 16-byte loop keeps four loads in flight per thread before storing, which is what
// a kernel reading mapped host memory over PCIe needs to hide its latency.

typedef unsigned long long u64;

template <typename T>
__device__ __forceinline__ void copy_words(const char* __restrict__ src, char* __restrict__ dst,
                                           u64 nbytes) {
    const T* s = reinterpret_cast<const T*>(src);
    T* d = reinterpret_cast<T*>(dst);
    const u64 n = nbytes / sizeof(T);
    const u64 step = blockDim.x;
    u64 i = threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) {
        T a = s[i];
        T b = s[i + step];
        T c = s[i + 2 * step];
        T e = s[i + 3 * step];
        d[i] = a;
        d[i + step] = b;
        d[i + 2 * step] = c;
        d[i + 3 * step] = e;
    }
    for (; i < n; i += step) {
        d[i] = s[i];
    }
}

__device__ __forceinline__ void copy_range(const char* src, char* dst, u64 nbytes) {
    const u64 align = reinterpret_cast<u64>(src) | reinterpret_cast<u64>(dst) | nbytes;
    if ((align & 15) == 0) {
        copy_words<uint4>(src, dst, nbytes);
    } else if ((align & 7) == 0) {
        copy_words<u64>(src, dst, nbytes);
    } else if ((align & 3) == 0) {
        copy_words<unsigned int>(src, dst, nbytes);
    } else {
        for (u64 i = threadIdx.x; i < nbytes; i += blockDim.x) {
            dst[i] = src[i];
        }
    }
}

extern "C" __global__ void gather_pages(const u64* __restrict__ desc, long long n_desc) {
    for (long long k = blockIdx.x; k < n_desc; k += gridDim.x) {
        const u64* d = desc + 3 * k;
        copy_range(reinterpret_cast<const char*>(d[0]), reinterpret_cast<char*>(d[1]), d[2]);
    }
}

extern "C" __global__ void scatter_pages(const u64* __restrict__ desc, long long n_desc) {
    for (long long k = blockIdx.x; k < n_desc; k += gridDim.x) {
        const u64* d = desc + 3 * k;
        copy_range(reinterpret_cast<const char*>(d[1]), reinterpret_cast<char*>(d[0]), d[2]);
    }
}
