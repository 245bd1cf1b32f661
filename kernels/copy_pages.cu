// Page gather / scatter for the lmc-server CUDA transfer engine.
//
// The host uploads one *unit* row per (layer run, chunk) and the chunk's block ids; the
// kernels compute every page address themselves, so the host never expands a request
// into per-page descriptors. A unit row is ten 64-bit words:
//
//   0 page_base     device address of the run's layer 0, block 0 (buffer + base offset)
//   1 layer_stride  bytes between the run's layers (signed)
//   2 block_stride  bytes between consecutive block ids (signed)
//   3 page_bytes    bytes per page
//   4 object        address of the unit's object bytes: a GPU staging buffer (copy mode
//                   "staging") or the mapped pinned host pool (copy mode "mapped")
//   5 ids_offset    index of the unit's first block id in the block-id array
//   6 n_layers
//   7 n_blocks
//   8 object_layer_stride   bytes between the unit's layers in the object
//   9 object_block_stride   bytes between its stored blocks in the object
//
// Page (layer i, stored block j) of a unit is at
//   page_base + i * layer_stride + ids[ids_offset + j] * block_stride
// and at object + i * object_layer_stride + j * object_block_stride in the object
// (objects are block-major: lmc_server/cache/layout.py). Block id -1 means
// "leave this page alone". Every page and object range was checked on the host before
// launch (lmc_server.transfer.cuda.plan), from the very arrays that were uploaded.
//
//   gather_units:  page   -> object   (store: engine pages into an object)
//   scatter_units: object -> page     (retrieve: an object back into engine pages)
//
// Pages are numbered unit-major over a (units, max_layers, max_blocks) box; thread
// block b copies pages b, b + gridDim.x, ... (slots outside a unit's own layers/blocks
// are skipped); its threads split one page's bytes. 16-byte vector loads/stores when
// both addresses and the length are 16-byte aligned (every DeepSeek-V4.1 page is:
// 19008, 16896 and 4224 bytes), 8- and 4-byte words when that is the widest common
// alignment, bytes otherwise. The 16-byte loop keeps four loads in flight per thread
// before storing, which is what a kernel reading mapped host memory over PCIe needs.

typedef unsigned long long u64;
typedef long long i64;

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

template <bool kToObject>
__device__ __forceinline__ void copy_units(const u64* __restrict__ units,
                                           const i64* __restrict__ ids, i64 n_units,
                                           i64 max_layers, i64 max_blocks) {
    const i64 per_unit = max_layers * max_blocks;
    const i64 total = n_units * per_unit;
    for (i64 k = blockIdx.x; k < total; k += gridDim.x) {
        const i64 u = k / per_unit;
        const i64 rem = k - u * per_unit;
        const i64 layer = rem / max_blocks;
        const i64 j = rem - layer * max_blocks;
        const u64* row = units + 10 * u;
        const i64 n_layers = static_cast<i64>(row[6]);
        const i64 n_blocks = static_cast<i64>(row[7]);
        if (layer >= n_layers || j >= n_blocks) {
            continue;
        }
        const i64 block = ids[static_cast<i64>(row[5]) + j];
        if (block < 0) {
            continue;
        }
        const u64 page_bytes = row[3];
        char* page = reinterpret_cast<char*>(row[0] + static_cast<u64>(
            layer * static_cast<i64>(row[1]) + block * static_cast<i64>(row[2])));
        char* object = reinterpret_cast<char*>(
            row[4] + static_cast<u64>(layer * static_cast<i64>(row[8])
                                      + j * static_cast<i64>(row[9])));
        if (kToObject) {
            copy_range(page, object, page_bytes);
        } else {
            copy_range(object, page, page_bytes);
        }
    }
}

extern "C" __global__ void gather_units(const u64* __restrict__ units,
                                        const i64* __restrict__ ids, i64 n_units,
                                        i64 max_layers, i64 max_blocks) {
    copy_units<true>(units, ids, n_units, max_layers, max_blocks);
}

extern "C" __global__ void scatter_units(const u64* __restrict__ units,
                                         const i64* __restrict__ ids, i64 n_units,
                                         i64 max_layers, i64 max_blocks) {
    copy_units<false>(units, ids, n_units, max_layers, max_blocks);
}
