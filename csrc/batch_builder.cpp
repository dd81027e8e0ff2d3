// opid_mega._C — batch construction for forked (shared-prefix) scoring, plain training micro-batches, and
// token advantages. Byte-identical to the numpy reference in opid_mega/batching/reference.py and
// opid_mega/batching/layout.py (read those for the semantics; this file mirrors them step by step).
//
// Inputs are 1-D C-contiguous buffers (numpy arrays; torch CPU tensors via .numpy()), never cast or copied:
// a wrong dtype is a TypeError, a bad shape/offset/length a ValueError naming the argument. Token ids come as
// int32 or int64 and are packed as int32 (int64 ids must fit). The GIL is released while working; the
// per-group fill and the per-sample prefix scan run on std::threads when the batch is large enough to pay for
// them. Everything here is bound by memory bandwidth: the packed outputs are written once, with streaming
// stores on whole cache lines.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

// Byte-identical advantages with numpy need unfused a + l * d (no FMA contraction, e.g. on aarch64 or -march=native).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#if defined(__SSE2__)
#include <emmintrin.h>
#define OPID_STREAM_STORES 1
#endif
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kMaxInt32 = 2147483647LL;
constexpr int64_t kMaxRanks = 1 << 20;
constexpr int64_t kMaxBins = 1 << 20;

// ------------------------------------------------------------------------------------------- buffers
template <class T>
struct Vec {
    const T* p = nullptr;
    int64_t n = 0;
    const T& operator[](int64_t i) const { return p[i]; }
};

enum class Kind { I32, I64, F32, F64, BOOL };

const char* kind_name(Kind k) {
    switch (k) {
        case Kind::I32: return "int32";
        case Kind::I64: return "int64";
        case Kind::F32: return "float32";
        case Kind::F64: return "float64";
        case Kind::BOOL: return "bool/uint8";
    }
    return "?";
}

bool is_kind(const py::buffer_info& info, Kind k) {
    switch (k) {
        case Kind::I32: return info.itemsize == 4 && info.item_type_is_equivalent_to<int32_t>();
        case Kind::I64: return info.itemsize == 8 && info.item_type_is_equivalent_to<int64_t>();
        case Kind::F32: return info.itemsize == 4 && info.item_type_is_equivalent_to<float>();
        case Kind::F64: return info.itemsize == 8 && info.item_type_is_equivalent_to<double>();
        case Kind::BOOL:
            return info.itemsize == 1 && (info.format == "?" || info.item_type_is_equivalent_to<uint8_t>());
    }
    return false;
}

// Request a 1-D contiguous buffer; returns the buffer_info (keeps the view alive) after checking it.
py::buffer_info request(const std::string& name, const py::handle& obj, std::initializer_list<Kind> kinds,
                        Kind* which, int64_t expected_len = -1) {
    if (!PyObject_CheckBuffer(obj.ptr())) {
        throw py::type_error(name + " must be a numpy array (or another buffer), got " +
                             std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
    }
    py::buffer_info info;
    try {
        info = py::reinterpret_borrow<py::buffer>(obj).request();
    } catch (py::error_already_set& e) {
        throw py::value_error(name + ": cannot read its buffer (" + std::string(e.what()) + ")");
    }
    bool ok = false;
    for (Kind k : kinds) {
        if (is_kind(info, k)) {
            ok = true;
            if (which) *which = k;
            break;
        }
    }
    if (!ok) {
        std::string allowed;
        for (Kind k : kinds) allowed += (allowed.empty() ? "" : ", ") + std::string(kind_name(k));
        throw py::type_error(name + " must have dtype " + allowed + ", got buffer format '" + info.format + "'");
    }
    if (info.ndim != 1) throw py::value_error(name + " must be 1-D, got " + std::to_string(info.ndim) + " dims");
    if (info.shape[0] > 1 && info.strides[0] != info.itemsize) throw py::value_error(name + " must be contiguous");
    if (expected_len >= 0 && info.shape[0] != expected_len) {
        throw py::value_error(name + " has length " + std::to_string(info.shape[0]) + ", expected " +
                              std::to_string(expected_len));
    }
    return info;
}

template <class T>
Vec<T> vec_of(const py::buffer_info& info) {
    return Vec<T>{static_cast<const T*>(info.ptr), static_cast<int64_t>(info.shape[0])};
}

// Large output buffers are recycled: an array's memory goes back to this pool when Python frees it, and the next
// batch (same sizes every iteration) reuses it instead of faulting in fresh pages the kernel must zero first.
// Capped at 1 GiB cached; OPID_BB_POOL=0 disables it; clear_buffer_pool() empties it.
class BufferPool {
public:
    static BufferPool& get() {
        static BufferPool* pool = new BufferPool();  // leaked on purpose: capsules may outlive module teardown
        return *pool;
    }
    void* take(size_t n, size_t* cap) {
        if (enabled_ && n >= kMinBytes) {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = free_.lower_bound(n);
            if (it != free_.end() && it->first <= 2 * n) {
                *cap = it->first;
                void* p = it->second;
                cached_ -= it->first;
                free_.erase(it);
                return p;
            }
        }
        if (n >= kHugeBytes) {
            // 2 MiB aligned + transparent huge pages (as numpy does for large arrays): far fewer page faults.
            *cap = (n + kHugeBytes - 1) / kHugeBytes * kHugeBytes;
            void* p = nullptr;
            if (posix_memalign(&p, kHugeBytes, *cap) != 0 || p == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
            madvise(p, *cap, MADV_HUGEPAGE);
#endif
            return p;
        }
        *cap = std::max<size_t>(n, 1);
        void* p = std::malloc(*cap);
        if (p == nullptr) throw std::bad_alloc();
        return p;
    }
    void give(void* p, size_t cap) {
        if (enabled_ && cap >= kMinBytes) {
            std::lock_guard<std::mutex> lock(mu_);
            if (cached_ + cap <= kMaxCached) {
                free_.emplace(cap, p);
                cached_ += cap;
                return;
            }
        }
        std::free(p);
    }
    size_t clear() {
        std::lock_guard<std::mutex> lock(mu_);
        size_t n = cached_;
        for (auto& kv : free_) std::free(kv.second);
        free_.clear();
        cached_ = 0;
        return n;
    }
    size_t cached() {
        std::lock_guard<std::mutex> lock(mu_);
        return cached_;
    }

private:
    BufferPool() {
        const char* env = std::getenv("OPID_BB_POOL");
        enabled_ = !(env != nullptr && std::string(env) == "0");
    }
    static constexpr size_t kMinBytes = size_t(1) << 20;
    static constexpr size_t kHugeBytes = size_t(1) << 21;
    static constexpr size_t kMaxCached = size_t(1) << 30;
    std::mutex mu_;
    std::multimap<size_t, void*> free_;
    size_t cached_ = 0;
    bool enabled_ = true;
};

struct PoolBlock {
    void* ptr;
    size_t cap;
};

template <class T>
py::array_t<T> new_array(int64_t n) {
    size_t cap = 0;
    void* p = BufferPool::get().take(static_cast<size_t>(n) * sizeof(T), &cap);
    auto* block = new PoolBlock{p, cap};
    py::capsule owner(block, [](void* b) {
        auto* blk = static_cast<PoolBlock*>(b);
        BufferPool::get().give(blk->ptr, blk->cap);
        delete blk;
    });
    return py::array_t<T>({static_cast<py::ssize_t>(n)}, {static_cast<py::ssize_t>(sizeof(T))}, static_cast<T*>(p),
                          owner);
}

int64_t check_int(const std::string& name, const py::handle& v, int64_t low, int64_t high) {
    if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr())) {
        throw py::type_error(name + " must be an int, got " +
                             std::string(py::str(py::type::handle_of(v).attr("__name__"))));
    }
    int overflow = 0;
    py::object idx = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
    if (!idx) throw py::error_already_set();
    long long x = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
    if (overflow || x < low || x > high) {
        throw py::value_error(name + "=" + std::string(py::str(v)) + " must be in [" + std::to_string(low) + ", " +
                              std::to_string(high) + "]");
    }
    return static_cast<int64_t>(x);
}

void check_bins(int64_t ranks, int64_t min_mb) {
    if (ranks * min_mb > kMaxBins) {
        throw py::value_error("num_ranks * min_micro_batches = " + std::to_string(ranks * min_mb) + " exceeds " +
                              std::to_string(kMaxBins));
    }
}

void check_offsets(const std::string& name, Vec<int64_t> off, int64_t total, const std::string& what) {
    if (off.n < 1) throw py::value_error(name + " must have at least one entry (0)");
    if (off[0] != 0) throw py::value_error(name + "[0] must be 0, got " + std::to_string(off[0]));
    for (int64_t i = 1; i < off.n; ++i) {
        if (off[i] < off[i - 1]) {
            throw py::value_error(name + " must be non-decreasing: " + name + "[" + std::to_string(i) + "]=" +
                                  std::to_string(off[i]) + " < " + name + "[" + std::to_string(i - 1) + "]=" +
                                  std::to_string(off[i - 1]));
        }
    }
    if (off[off.n - 1] != total) {
        throw py::value_error(name + "[-1]=" + std::to_string(off[off.n - 1]) + " must equal the number of " + what +
                              " (" + std::to_string(total) + ")");
    }
}

// ------------------------------------------------------------------------------------------- threads
// Worker threads: OPID_BB_THREADS if set (1 = no threads), else the hardware threads, at most 16.
int max_threads() {
    static const int n = []() {
        const char* env = std::getenv("OPID_BB_THREADS");
        if (env != nullptr && std::atoi(env) > 0) return std::min(std::atoi(env), 256);
        const unsigned hw = std::thread::hardware_concurrency();
        return static_cast<int>(std::min<unsigned>(hw == 0 ? 1 : hw, 16));
    }();
    return n;
}

int pick_threads(int64_t work) {
    int64_t t = max_threads();
    t = std::min<int64_t>(t, std::max<int64_t>(1, work / 262144));  // ~256k tokens per thread at least
    return static_cast<int>(std::max<int64_t>(t, 1));
}

// Run fn(i) for i in [0, n) on `threads` threads, dynamic chunks. fn must not throw.
void parallel_for(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn) {
    if (threads <= 1 || n < 2) {
        fn(0, n);
        return;
    }
    std::atomic<int64_t> next{0};
    const int64_t chunk = std::max<int64_t>(1, n / (threads * 8));
    auto worker = [&]() {
        while (true) {
            int64_t b = next.fetch_add(chunk);
            if (b >= n) break;
            fn(b, std::min(n, b + chunk));
        }
    };
    std::vector<std::thread> pool;
    pool.reserve(threads - 1);
    for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
    for (auto& th : pool) th.join();
}

// ------------------------------------------------------------------------------------------- streaming stores
// The packed outputs (hundreds of MB) are written once and not read back here: non-temporal stores skip the
// read-for-ownership of every destination cache line, which is a third of the memory traffic of these loops.
// Each worker calls store_fence() before its data is published (end of its chunk).
#if OPID_STREAM_STORES
// Streaming stores cover whole 64-byte lines only, [head, body): the partial lines at both ends of a run get
// ordinary stores, so no line is written half through the cache and half around it (runs are short: a prompt
// tail, a response). (AVX2 and AVX-512 streaming stores were measured too: no faster, the loops are memory-bound.)
struct Lines {
    int64_t head, body;
};

inline Lines whole_lines(const int32_t* dst, int64_t n) {
    int64_t head = 0;
    while (head < n && (reinterpret_cast<uintptr_t>(dst + head) & 63) != 0) ++head;
    return {head, head + (n - head) / 16 * 16};
}

inline void stream_iota32(int32_t* dst, int32_t start, int64_t n) {
    const Lines L = whole_lines(dst, n);
    int64_t i = L.head;
    for (int64_t j = 0; j < i; ++j) dst[j] = start + static_cast<int32_t>(j);
    __m128i v = _mm_add_epi32(_mm_set1_epi32(start + static_cast<int32_t>(i)), _mm_setr_epi32(0, 1, 2, 3));
    for (; i < L.body; i += 4) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), v);
        v = _mm_add_epi32(v, _mm_set1_epi32(4));
    }
    for (; i < n; ++i) dst[i] = start + static_cast<int32_t>(i);
}

inline void stream_fill32(int32_t* dst, int32_t value, int64_t n) {
    const Lines L = whole_lines(dst, n);
    int64_t i = L.head;
    std::fill(dst, dst + i, value);
    for (; i < L.body; i += 4) _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_set1_epi32(value));
    for (; i < n; ++i) dst[i] = value;
}

// Token ids -> int32 output. Returns whether every id fits int32 (always, for int32 input).
inline bool stream_tokens(int32_t* dst, const int32_t* src, int64_t n) {
    const Lines L = whole_lines(dst, n);
    int64_t i = L.head;
    std::copy(src, src + i, dst);
    for (; i < L.body; i += 4) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    }
    for (; i < n; ++i) dst[i] = src[i];
    return true;
}

// int64 ids keep their low 32 bits; one fits iff its high half equals the sign of its low half (checked on the way:
// the caller raises, naming the first id that does not fit, when any of them fails).
inline bool stream_tokens(int32_t* dst, const int64_t* src, int64_t n) {
    const Lines L = whole_lines(dst, n);
    int64_t i = L.head;
    bool fits = true;
    for (int64_t j = 0; j < i; ++j) {
        dst[j] = static_cast<int32_t>(src[j]);
        fits &= dst[j] == src[j];
    }
    __m128i all = _mm_set1_epi32(-1);
    for (; i < L.body; i += 4) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 2));
        all = _mm_and_si128(all, _mm_cmpeq_epi32(x, _mm_shuffle_epi32(_mm_srai_epi32(x, 31), 0xA0)));
        all = _mm_and_si128(all, _mm_cmpeq_epi32(y, _mm_shuffle_epi32(_mm_srai_epi32(y, 31), 0xA0)));
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm_unpacklo_epi64(_mm_shuffle_epi32(x, 0x88), _mm_shuffle_epi32(y, 0x88)));
    }
    fits &= (_mm_movemask_ps(_mm_castsi128_ps(all)) & 0xA) == 0xA;  // the high-half lanes
    for (; i < n; ++i) {
        dst[i] = static_cast<int32_t>(src[i]);
        fits &= dst[i] == src[i];
    }
    return fits;
}

// float outputs are streamed as their 32-bit patterns (the buffers are raw memory that only numpy reads back).
inline void stream_fill32(float* dst, float value, int64_t n) {
    int32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    stream_fill32(reinterpret_cast<int32_t*>(dst), bits, n);
}

inline void stream_copy32(float* dst, const float* src, int64_t n) {
    stream_tokens(reinterpret_cast<int32_t*>(dst), reinterpret_cast<const int32_t*>(src), n);
}

inline void store_fence() { _mm_sfence(); }
#else  // portable fallback (e.g. aarch64): plain stores
inline void stream_iota32(int32_t* dst, int32_t start, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = start + static_cast<int32_t>(i);
}
inline void stream_fill32(int32_t* dst, int32_t value, int64_t n) { std::fill(dst, dst + n, value); }
inline void stream_fill32(float* dst, float value, int64_t n) { std::fill(dst, dst + n, value); }
inline void stream_copy32(float* dst, const float* src, int64_t n) { std::copy(src, src + n, dst); }
template <class TI>
inline bool stream_tokens(int32_t* dst, const TI* src, int64_t n) {
    bool fits = true;
    for (int64_t i = 0; i < n; ++i) {
        dst[i] = static_cast<int32_t>(src[i]);
        fits &= dst[i] == src[i];
    }
    return fits;
}
inline void store_fence() {}
#endif

// ------------------------------------------------------------------------------------------- exact sum
// Correctly rounded sum of doubles (Shewchuk's partials, as Python's math.fsum), streaming. Inputs must be finite.
class ExactSum {
public:
    void add(double x) {
        size_t i = 0;
        for (size_t j = 0; j < p_.size(); ++j) {
            double y = p_[j];
            if (std::fabs(x) < std::fabs(y)) std::swap(x, y);
            double hi = x + y;
            double lo = y - (hi - x);
            if (lo != 0.0) p_[i++] = lo;
            x = hi;
        }
        p_.resize(i);
        if (x != 0.0) p_.push_back(x);
    }
    double result() const;

private:
    std::vector<double> p_;
};

double exact_sum(const std::vector<double>& xs) {
    ExactSum acc;
    for (double x : xs) acc.add(x);
    return acc.result();
}

double ExactSum::result() const {
    const std::vector<double>& p = p_;
    double hi = 0.0;
    size_t n = p.size();
    if (n > 0) {
        double lo = 0.0;
        hi = p[--n];
        while (n > 0) {
            double x = hi;
            double y = p[--n];
            hi = x + y;
            double yr = hi - x;
            lo = y - yr;
            if (lo != 0.0) break;
        }
        if (n > 0 && ((lo < 0.0 && p[n - 1] < 0.0) || (lo > 0.0 && p[n - 1] > 0.0))) {
            double y = lo * 2.0;
            double x = hi + y;
            double yr = x - hi;
            if (y == yr) hi = x;
        }
    }
    return hi;
}

// ------------------------------------------------------------------------------------------- packing
struct Plan {
    std::vector<int64_t> mb_of_group;  // rank-major flat micro-batch index
    int64_t per_rank = 1;
};

Plan plan_groups(const std::vector<int64_t>& sizes, int64_t budget, int64_t ranks, int64_t min_mb) {
    const int64_t G = static_cast<int64_t>(sizes.size());
    for (int64_t g = 0; g < G; ++g) {
        if (sizes[g] < 0) throw py::value_error("group_tokens[" + std::to_string(g) + "]=" + std::to_string(sizes[g]) +
                                                " must be >= 0");
        if (sizes[g] > budget) {
            throw py::value_error("group " + std::to_string(g) + " needs " + std::to_string(sizes[g]) +
                                  " tokens, more than the micro-batch budget " + std::to_string(budget));
        }
    }
    // Longest first, ties by group id: stable LSD radix sort of the group ids by (budget - size), 11 bits a pass.
    std::vector<int64_t> order(G), scratch(G);
    for (int64_t g = 0; g < G; ++g) order[g] = g;
    for (int shift = 0; (budget >> shift) > 0; shift += 11) {
        int64_t count[2049] = {0};
        for (int64_t g : order) ++count[(((budget - sizes[g]) >> shift) & 2047) + 1];
        for (int d = 0; d < 2048; ++d) count[d + 1] += count[d];
        for (int64_t g : order) scratch[count[((budget - sizes[g]) >> shift) & 2047]++] = g;
        order.swap(scratch);
    }
    int64_t total = 0;
    for (int64_t s : sizes) total += s;
    const int64_t cap = budget * ranks;
    int64_t m = std::max<int64_t>(min_mb, (total + cap - 1) / cap);
    std::vector<int64_t> bin_of(G, 0);
    // The least loaded bin (ties: lowest bin) is the minimum of the keys (load << 32 | bin), kept in a tournament
    // tree: leaves are the bins, each inner node the smaller of its children, so the root is the answer and
    // an update rewrites one leaf-to-root path of branch-free minimums.
    std::vector<int64_t> tree;
    while (true) {
        const int64_t bins = ranks * m;
        int64_t P = 1;
        while (P < bins) P *= 2;
        tree.assign(2 * P, INT64_MAX);
        for (int64_t b = 0; b < bins; ++b) tree[P + b] = b;
        for (int64_t i = P - 1; i >= 1; --i) tree[i] = std::min(tree[2 * i], tree[2 * i + 1]);
        bool ok = true;
        for (int64_t g : order) {
            const int64_t load = tree[1] >> 32, bin = tree[1] & 0xFFFFFFFFLL;
            if (load + sizes[g] > budget) {
                ok = false;
                break;
            }
            bin_of[g] = bin;
            int64_t i = P + bin;
            tree[i] = ((load + sizes[g]) << 32) | bin;
            for (i >>= 1; i >= 1; i >>= 1) tree[i] = std::min(tree[2 * i], tree[2 * i + 1]);
        }
        if (ok) break;
        ++m;
    }
    Plan plan;
    plan.per_rank = m;
    plan.mb_of_group.resize(G);
    for (int64_t g = 0; g < G; ++g) plan.mb_of_group[g] = (bin_of[g] % ranks) * m + bin_of[g] / ranks;
    return plan;
}

// ------------------------------------------------------------------------------------------- layout
// Token ids come as int32 or int64 (exactly one of t32/t64 is set); the packed outputs are int32.
struct Ctx {
    const int32_t* t32 = nullptr;
    const int64_t* t64 = nullptr;
    int64_t ntok = 0;
    Vec<int64_t> co, rl, so;
};

// f(token pointer) with the pointer of the input's dtype.
template <class F>
void with_tokens(const Ctx& in, F&& f) {
    if (in.t64 != nullptr) {
        f(in.t64);
    } else {
        f(in.t32);
    }
}

// First index of t[0:n] whose value does not fit int32, or -1 (the error path of the fill's check).
int64_t first_not_int32(const int64_t* t, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        if (t[i] < INT32_MIN || t[i] > INT32_MAX) return i;
    }
    return -1;
}

inline uint64_t mix(uint64_t h, uint64_t x) {
    x *= 0x9E3779B97F4A7C15ULL;
    x ^= x >> 32;
    h ^= x;
    h *= 0xBF58476D1CE4E5B9ULL;
    return h ^ (h >> 29);
}

#if OPID_STREAM_STORES
// Leading bytes of x and y (at most nbytes) that lie in equal 64-byte blocks, compared with vector loads (no call
// per block) and prefetched ahead: the caller scans the first differing block itself.
int64_t equal_blocks(const char* x, const char* y, int64_t nbytes) {
    int64_t q = 0;
    for (; q + 64 <= nbytes; q += 64) {
        _mm_prefetch(x + q + 2048, _MM_HINT_T0);
        _mm_prefetch(y + q + 2048, _MM_HINT_T0);
        __m128i eq = _mm_set1_epi8(-1);
        for (int k = 0; k < 64; k += 16) {
            eq = _mm_and_si128(eq, _mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + q + k)),
                                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(y + q + k))));
        }
        if (_mm_movemask_epi8(eq) != 0xFFFF) break;
    }
    return q;
}

#endif

// Length of the common prefix of a[0:n] and b[0:n].
template <class TI>
int64_t common_prefix(const TI* a, const TI* b, int64_t n) {
    int64_t q = 0;
#if OPID_STREAM_STORES
    const char* x = reinterpret_cast<const char*>(a);
    const char* y = reinterpret_cast<const char*>(b);
    const int64_t nbytes = n * static_cast<int64_t>(sizeof(TI));
    q = equal_blocks(x, y, nbytes) / static_cast<int64_t>(sizeof(TI));
#endif
    while (q < n && a[q] == b[q]) ++q;
    return q;
}

// Bucket key of a prefix: its length and up to 64 tokens at each end (equality is always checked in full), mixed
// in four independent lanes so that the multiply chains overlap.
template <class TI>
uint64_t prefix_hash(const TI* t, int64_t p) {
    uint64_t lane[4] = {0x243F6A8885A308D3ULL ^ static_cast<uint64_t>(p), 0x13198A2E03707344ULL,
                        0xA4093822299F31D0ULL, 0x082EFA98EC4E6C89ULL};
    auto feed = [&](int64_t q0, int64_t q1) {
        int64_t q = q0;
        for (; q + 4 <= q1; q += 4) {
            for (int k = 0; k < 4; ++k) lane[k] = mix(lane[k], static_cast<uint64_t>(t[q + k]));
        }
        for (; q < q1; ++q) lane[0] = mix(lane[0], static_cast<uint64_t>(t[q]));
    };
    const int64_t head = std::min<int64_t>(p, 64);
    feed(0, head);
    feed(std::max<int64_t>(head, p - 64), p);
    return mix(mix(mix(lane[0], lane[1]), lane[2]), lane[3]);
}

py::dict build_batches(py::object tokens_o, py::object ctx_offsets_o, py::object resp_lens_o,
                       py::object sample_offsets_o, py::object budget_o, py::object num_ranks_o, bool plain,
                       bool share_prompts, py::object max_group_tokens_o, py::object min_micro_batches_o,
                       py::object token_values_o) {
    // --- validation (GIL held: error messages may touch Python objects)
    Kind tok_kind;
    py::buffer_info tokens_i = request("tokens", tokens_o, {Kind::I32, Kind::I64}, &tok_kind);
    py::buffer_info co_i = request("ctx_offsets", ctx_offsets_o, {Kind::I64}, nullptr);
    py::buffer_info so_i = request("sample_offsets", sample_offsets_o, {Kind::I64}, nullptr);
    // Offsets and lengths are copied (small) before they are validated, so that a concurrent writer in another
    // Python thread cannot turn validated offsets into out-of-range reads while the GIL is released.
    auto copy_of = [](const py::buffer_info& info) {
        const int64_t* p = static_cast<const int64_t*>(info.ptr);
        return std::vector<int64_t>(p, p + info.shape[0]);
    };
    const std::vector<int64_t> co_v = copy_of(co_i), so_v = copy_of(so_i);
    Ctx in;
    in.ntok = static_cast<int64_t>(tokens_i.shape[0]);
    if (tok_kind == Kind::I64) {
        in.t64 = static_cast<const int64_t*>(tokens_i.ptr);
    } else {
        in.t32 = static_cast<const int32_t*>(tokens_i.ptr);
    }
    in.co = Vec<int64_t>{co_v.data(), static_cast<int64_t>(co_v.size())};
    in.so = Vec<int64_t>{so_v.data(), static_cast<int64_t>(so_v.size())};
    check_offsets("ctx_offsets", in.co, in.ntok, "tokens");
    const int64_t C = in.co.n - 1;
    py::buffer_info rl_i = request("resp_lens", resp_lens_o, {Kind::I64}, nullptr, C);
    const std::vector<int64_t> rl_v = copy_of(rl_i);
    in.rl = Vec<int64_t>{rl_v.data(), static_cast<int64_t>(rl_v.size())};
    check_offsets("sample_offsets", in.so, C, "contexts");
    const int64_t S = in.so.n - 1;
    for (int64_t s = 0; s < S; ++s) {
        if (in.so[s + 1] == in.so[s]) {
            throw py::value_error("sample_offsets: sample " + std::to_string(s) + " has no context");
        }
    }
    for (int64_t c = 0; c < C; ++c) {
        const int64_t len = in.co[c + 1] - in.co[c];
        if (in.rl[c] < 0 || in.rl[c] >= len) {
            throw py::value_error("resp_lens[" + std::to_string(c) + "]=" + std::to_string(in.rl[c]) +
                                  " must be in [0, context length - 1] (context length " + std::to_string(len) +
                                  ": a context needs at least one prompt token)");
        }
    }
    if (plain) {
        for (int64_t s = 0; s < S; ++s) {
            if (in.so[s + 1] - in.so[s] != 1) {
                throw py::value_error("sample_offsets: plain layout needs exactly one context per sample, sample " +
                                      std::to_string(s) + " has " + std::to_string(in.so[s + 1] - in.so[s]));
            }
        }
    }
    const int64_t budget = check_int("budget", budget_o, 1, kMaxInt32);
    const int64_t ranks = check_int("num_ranks", num_ranks_o, 1, kMaxRanks);
    const int64_t max_group =
        max_group_tokens_o.is_none() ? budget : check_int("max_group_tokens", max_group_tokens_o, 1, budget);
    const int64_t min_mb = check_int("min_micro_batches", min_micro_batches_o, 1, kMaxRanks);
    check_bins(ranks, min_mb);
    int64_t total_resp = 0;
    for (int64_t c = 0; c < C; ++c) total_resp += in.rl[c];
    const bool has_values = !token_values_o.is_none();
    py::buffer_info tv_i;
    Vec<float> tv;
    if (has_values) {
        tv_i = request("token_values", token_values_o, {Kind::F32}, nullptr, total_resp);
        tv = vec_of<float>(tv_i);
    }
    const bool share = share_prompts && !plain;

    // --- per-sample prefixes, grouping, plan (no GIL)
    std::vector<int64_t> prefix(S), size_of(S), hash(S, 0);
    std::vector<int64_t> grp_off{0}, grp_samples, grp_prefix, grp_tokens;
    Plan plan;
    {
        py::gil_scoped_release release;
        const int threads = plain ? 1 : pick_threads(in.ntok);  // plain: lengths only
        with_tokens(in, [&](auto tok) {
        parallel_for(S, threads, [&](int64_t lo, int64_t hi) {
            for (int64_t s = lo; s < hi; ++s) {
                const int64_t c0 = in.so[s], c1 = in.so[s + 1];
                int64_t p;
                int64_t total = 0;
                for (int64_t c = c0; c < c1; ++c) total += in.co[c + 1] - in.co[c];
                if (plain) {
                    p = in.co[c0 + 1] - in.co[c0];
                } else {
                    p = INT64_MAX;
                    for (int64_t c = c0; c < c1; ++c) p = std::min(p, in.co[c + 1] - in.co[c] - in.rl[c]);
                    const auto* first = tok + in.co[c0];
                    for (int64_t c = c0 + 1; c < c1; ++c) p = common_prefix(first, tok + in.co[c], p);
                }
                prefix[s] = p;
                size_of[s] = total - (c1 - c0 - 1) * p;
                if (share && p > 0) hash[s] = static_cast<int64_t>(prefix_hash(tok + in.co[c0], p));
            }
        });
        });
    }
    for (int64_t s = 0; s < S; ++s) {
        if (size_of[s] > max_group) {
            throw py::value_error("sample " + std::to_string(s) + " needs " + std::to_string(size_of[s]) +
                                  " tokens, more than the micro-batch budget " + std::to_string(max_group));
        }
    }
    {
        py::gil_scoped_release release;
        // Samples with token-identical prefixes share a group, in sample order. An open-addressing table maps a
        // prefix hash to a chain of entries (one per distinct prefix with that hash: the sample that opened it
        // and its currently open group); members of a group are a linked list until they are flattened.
        struct Entry {
            uint64_t hash;
            int64_t rep, group, next;  // next entry with the same hash, or -1
        };
        std::vector<Entry> entries;
        int64_t table_size = 1;
        while (table_size < 2 * S) table_size *= 2;
        std::vector<int64_t> table(share ? table_size : 0, -1);  // slot -> first entry with that hash
        std::vector<int64_t> next_member(S, -1), first_member, last_member;
        first_member.reserve(S);
        last_member.reserve(S);
        grp_prefix.reserve(S);
        grp_tokens.reserve(S);
        const size_t width = in.t64 != nullptr ? 8 : 4;
        const char* base = in.t64 != nullptr ? reinterpret_cast<const char*>(in.t64)
                                             : reinterpret_cast<const char*>(in.t32);
        for (int64_t s = 0; s < S; ++s) {
            const int64_t p = prefix[s];
            if (share && p > 0) {
                const uint64_t h = static_cast<uint64_t>(hash[s]);
                int64_t slot = static_cast<int64_t>(h & static_cast<uint64_t>(table_size - 1));
                while (table[slot] >= 0 && entries[table[slot]].hash != h) slot = (slot + 1) & (table_size - 1);
                const char* mine = base + in.co[in.so[s]] * width;
                int64_t found = -1;
                for (int64_t e = table[slot]; e >= 0; e = entries[e].next) {
                    const int64_t rep = entries[e].rep;
                    if (prefix[rep] == p &&
                        std::memcmp(base + in.co[in.so[rep]] * width, mine, static_cast<size_t>(p) * width) == 0) {
                        found = e;
                        break;
                    }
                }
                if (found >= 0 && grp_tokens[entries[found].group] + size_of[s] - p <= max_group) {
                    const int64_t g = entries[found].group;
                    next_member[last_member[g]] = s;
                    last_member[g] = s;
                    grp_tokens[g] += size_of[s] - p;
                    continue;
                }
                const int64_t g = static_cast<int64_t>(first_member.size());
                if (found >= 0) {
                    entries[found].group = g;
                } else {
                    entries.push_back(Entry{h, s, g, table[slot]});
                    table[slot] = static_cast<int64_t>(entries.size()) - 1;
                }
            }
            first_member.push_back(s);
            last_member.push_back(s);
            grp_prefix.push_back(p);
            grp_tokens.push_back(size_of[s]);
        }
        grp_samples.reserve(S);
        grp_off.reserve(first_member.size() + 1);
        for (int64_t first : first_member) {
            for (int64_t s = first; s >= 0; s = next_member[s]) grp_samples.push_back(s);
            grp_off.push_back(static_cast<int64_t>(grp_samples.size()));
        }
    }
    plan = plan_groups(grp_tokens, budget, ranks, min_mb);  // may throw (cannot: groups fit by construction)
    const int64_t G = static_cast<int64_t>(grp_prefix.size());
    const int64_t K = ranks * plan.per_rank;

    // --- offsets (no GIL)
    std::vector<int64_t> mb_group_off(K + 1, 0), mb_group_ids(G), grp_gather(G, 0);
    std::vector<int64_t> mb_tok(K + 1, 0), mb_gather(K + 1, 0), mb_cu(K + 1, 0);
    std::vector<int64_t> grp_tok_start(G), grp_row_start(G), grp_gather_start(G);
    {
        py::gil_scoped_release release;
        for (int64_t g = 0; g < G; ++g) mb_group_off[plan.mb_of_group[g] + 1] += 1;
        for (int64_t k = 0; k < K; ++k) mb_group_off[k + 1] += mb_group_off[k];
        std::vector<int64_t> fill(mb_group_off.begin(), mb_group_off.end() - 1);
        for (int64_t g = 0; g < G; ++g) mb_group_ids[fill[plan.mb_of_group[g]]++] = g;
        for (int64_t g = 0; g < G; ++g) {
            int64_t r = 0;
            for (int64_t i = grp_off[g]; i < grp_off[g + 1]; ++i) {
                const int64_t s = grp_samples[i];
                for (int64_t c = in.so[s]; c < in.so[s + 1]; ++c) r += in.rl[c];
            }
            grp_gather[g] = r;
        }
        int64_t tok = 0, gat = 0, cu = 0;
        for (int64_t k = 0; k < K; ++k) {
            int64_t row = 0;
            for (int64_t i = mb_group_off[k]; i < mb_group_off[k + 1]; ++i) {
                const int64_t g = mb_group_ids[i];
                grp_tok_start[g] = tok;
                grp_row_start[g] = row;
                grp_gather_start[g] = gat;
                tok += grp_tokens[g];
                row += grp_tokens[g];
                gat += grp_gather[g];
            }
            cu += mb_group_off[k + 1] - mb_group_off[k] + 1;
            mb_tok[k + 1] = tok;
            mb_gather[k + 1] = gat;
            mb_cu[k + 1] = cu;
        }
    }
    const int64_t N = mb_tok[K], M = mb_gather[K];

    // --- allocate outputs (GIL)
    auto tokens_out = new_array<int32_t>(N);
    auto pos_out = new_array<int32_t>(N);
    py::array_t<int32_t> br_out;  // the plain layout has no branches
    if (!plain) br_out = new_array<int32_t>(N);
    py::array_t<bool> mask_out;
    if (plain) mask_out = new_array<bool>(N);
    auto rows_out = new_array<int32_t>(M);
    auto tgt_out = new_array<int32_t>(M);
    auto cu_out = new_array<int32_t>(mb_cu[K]);
    auto ctx_start_out = new_array<int64_t>(C);
    auto ctx_mb_out = new_array<int64_t>(C);
    py::array_t<float> gval_out;
    if (has_values) gval_out = new_array<float>(M);
    int32_t* T = tokens_out.mutable_data();
    int32_t* P = pos_out.mutable_data();
    int32_t* B = plain ? nullptr : br_out.mutable_data();
    bool* LM = plain ? mask_out.mutable_data() : nullptr;
    int32_t* GR = rows_out.mutable_data();
    int32_t* GT = tgt_out.mutable_data();
    int32_t* CU = cu_out.mutable_data();
    int64_t* CS = ctx_start_out.mutable_data();
    int64_t* CM = ctx_mb_out.mutable_data();
    float* GV = has_values ? gval_out.mutable_data() : nullptr;

    // --- fill (no GIL, parallel over groups). Every token id passes through a copy here (a shared prefix equals
    // the copied one), so int64 ids are range-checked on the way rather than in a pass of their own.
    std::atomic<bool> all_fit{true};
    {
        py::gil_scoped_release release;
        std::vector<int64_t> value_off;
        if (has_values) {
            value_off.assign(C + 1, 0);
            for (int64_t c = 0; c < C; ++c) value_off[c + 1] = value_off[c] + in.rl[c];
        }
        for (int64_t k = 0; k < K; ++k) {
            int32_t* cu = CU + mb_cu[k];
            cu[0] = 0;
            int64_t j = 1;
            for (int64_t i = mb_group_off[k]; i < mb_group_off[k + 1]; ++i) {
                const int64_t g = mb_group_ids[i];
                cu[j++] = static_cast<int32_t>(grp_row_start[g] + grp_tokens[g]);
            }
        }
        const int threads = pick_threads(N);
        with_tokens(in, [&](auto tok) {
        parallel_for(G, threads, [&](int64_t lo, int64_t hi) {
            for (int64_t g = lo; g < hi; ++g) {
                const int64_t k = plan.mb_of_group[g];
                const int64_t p = grp_prefix[g];
                const int64_t t0 = grp_tok_start[g];
                const int64_t l0 = grp_row_start[g];
                const int64_t first = in.co[in.so[grp_samples[grp_off[g]]]];
                bool fits = stream_tokens(T + t0, tok + first, p);
                stream_iota32(P + t0, 0, static_cast<int32_t>(p));
                if (B) stream_fill32(B + t0, 0, p);
                int64_t cursor = t0 + p;  // global token index
                int64_t lrow = l0 + p;    // local row in the micro-batch
                int64_t m = grp_gather_start[g];
                int32_t branch = 0;
                for (int64_t i = grp_off[g]; i < grp_off[g + 1]; ++i) {
                    const int64_t s = grp_samples[i];
                    for (int64_t c = in.so[s]; c < in.so[s + 1]; ++c) {
                        ++branch;
                        const int64_t o = in.co[c];
                        const int64_t len = in.co[c + 1] - o;
                        const int64_t r = in.rl[c];
                        const int64_t own = len - p;
                        fits &= stream_tokens(T + cursor, tok + o + p, own);
                        stream_iota32(P + cursor, static_cast<int32_t>(p), own);
                        if (B) stream_fill32(B + cursor, branch, own);
                        CS[c] = m;
                        CM[c] = k;
                        // Response token q (context position) is predicted by the row of position q - 1: a shared
                        // prefix row (q - 1 < p) or one of this branch's own rows; each kind is a contiguous run.
                        const int64_t q0 = len - r, q_own = std::min(len, std::max(q0, p + 1));
                        int32_t* __restrict gr = GR + m - q0;
                        for (int64_t q = q0; q < q_own; ++q) gr[q] = static_cast<int32_t>(l0 + q - 1);
                        for (int64_t q = q_own; q < len; ++q) gr[q] = static_cast<int32_t>(lrow - p + q - 1);
                        int32_t* __restrict gt = GT + m;
                        const auto* __restrict resp = tok + o + q0;
                        for (int64_t j = 0; j < r; ++j) gt[j] = static_cast<int32_t>(resp[j]);
                        if (GV) std::memcpy(GV + m, tv.p + value_off[c], sizeof(float) * r);
                        if (LM) {
                            // Plain layout (the only one with per-row outputs): one context per group, all of it
                            // the "prefix", so rows t0 + q0 - 1 .. t0 + len - 2 predict the response; written in
                            // order, zeros around them.
                            std::fill(LM + t0, LM + t0 + q0 - 1, false);
                            std::fill(LM + t0 + q0 - 1, LM + t0 + q0 - 1 + r, true);
                            LM[t0 + len - 1] = false;
                        }
                        m += r;
                        cursor += own;
                        lrow += own;
                    }
                }
                if (!fits) all_fit = false;
            }
            store_fence();
        });
        });
    }
    if (!all_fit) {  // only int64 input can fail; name the first id that does not fit
        const int64_t bad = first_not_int32(in.t64, in.ntok);
        if (bad < 0) throw std::logic_error("batch builder: int32 range check failed without a culprit");
        throw py::value_error("tokens[" + std::to_string(bad) + "]=" + std::to_string(in.t64[bad]) +
                              " does not fit in int32 (packed token ids are int32)");
    }

    // --- small outputs
    auto to_np = [](const std::vector<int64_t>& v) {
        auto a = new_array<int64_t>(static_cast<int64_t>(v.size()));
        if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(int64_t));
        return a;
    };
    py::dict out;
    out["tokens"] = tokens_out;
    out["position_ids"] = pos_out;
    if (!plain) out["branch_ids"] = br_out;
    if (plain) out["loss_mask"] = mask_out;
    out["gather_rows"] = rows_out;
    out["gather_targets"] = tgt_out;
    out["cu_seqlens"] = cu_out;
    if (has_values) out["gather_values"] = gval_out;
    out["num_ranks"] = ranks;
    out["micro_batches_per_rank"] = plan.per_rank;
    out["mb_token_offsets"] = to_np(mb_tok);
    out["mb_gather_offsets"] = to_np(mb_gather);
    out["mb_cu_offsets"] = to_np(mb_cu);
    out["mb_group_offsets"] = to_np(mb_group_off);
    out["mb_group_ids"] = to_np(mb_group_ids);
    out["group_sample_offsets"] = to_np(grp_off);
    out["group_samples"] = to_np(grp_samples);
    out["group_prefix_lens"] = to_np(grp_prefix);
    out["group_tokens"] = to_np(grp_tokens);
    out["group_micro_batch"] = to_np(plan.mb_of_group);
    out["sample_prefix_lens"] = to_np(prefix);
    out["ctx_gather_start"] = ctx_start_out;
    out["ctx_micro_batch"] = ctx_mb_out;
    return out;
}

py::tuple plan_micro_batches(py::object group_tokens_o, py::object budget_o, py::object num_ranks_o,
                             py::object min_micro_batches_o) {
    py::buffer_info gi = request("group_tokens", group_tokens_o, {Kind::I64}, nullptr);
    const int64_t budget = check_int("budget", budget_o, 1, kMaxInt32);
    const int64_t ranks = check_int("num_ranks", num_ranks_o, 1, kMaxRanks);
    const int64_t min_mb = check_int("min_micro_batches", min_micro_batches_o, 1, kMaxRanks);
    check_bins(ranks, min_mb);
    Vec<int64_t> g = vec_of<int64_t>(gi);
    std::vector<int64_t> sizes(g.p, g.p + g.n);
    Plan plan;
    {
        // plan_groups throws py::value_error (a C++ exception, no Python state) on bad sizes.
        py::gil_scoped_release release;
        plan = plan_groups(sizes, budget, ranks, min_mb);
    }
    auto a = new_array<int64_t>(static_cast<int64_t>(plan.mb_of_group.size()));
    if (!plan.mb_of_group.empty()) {
        std::memcpy(a.mutable_data(), plan.mb_of_group.data(), plan.mb_of_group.size() * sizeof(int64_t));
    }
    return py::make_tuple(a, plan.per_rank);
}

// ------------------------------------------------------------------------------------------- advantages
std::vector<double> to_doubles(const py::buffer_info& info, Kind kind) {
    const int64_t n = info.shape[0];
    std::vector<double> v(n);
    if (kind == Kind::F32) {
        const float* p = static_cast<const float*>(info.ptr);
        for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>(p[i]);
    } else {
        const double* p = static_cast<const double*>(info.ptr);
        for (int64_t i = 0; i < n; ++i) v[i] = p[i];
    }
    return v;
}

py::array_t<double> outcome_advantage(py::object scores_o, py::object group_ids_o, const std::string& mode,
                                      double eps) {
    if (mode != "mean_std_norm" && mode != "mean_norm") {
        throw py::value_error("mode='" + mode + "', allowed: mean_std_norm, mean_norm");
    }
    Kind sk;
    py::buffer_info si = request("scores", scores_o, {Kind::F32, Kind::F64}, &sk);
    const int64_t S = si.shape[0];
    py::buffer_info gi = request("group_ids", group_ids_o, {Kind::I64}, nullptr, S);
    std::vector<double> x = to_doubles(si, sk);
    for (int64_t i = 0; i < S; ++i) {
        if (!std::isfinite(x[i])) throw py::value_error("scores[" + std::to_string(i) + "] is not finite");
    }
    Vec<int64_t> gid = vec_of<int64_t>(gi);
    auto out = new_array<double>(S);
    double* o = out.mutable_data();
    {
        py::gil_scoped_release release;
        std::unordered_map<int64_t, std::vector<int64_t>> members;
        for (int64_t i = 0; i < S; ++i) members[gid[i]].push_back(i);
        std::vector<double> buf;
        for (auto& kv : members) {
            const auto& idx = kv.second;
            const int64_t n = static_cast<int64_t>(idx.size());
            double mu = 0.0, sigma = 1.0;
            if (n > 1) {
                buf.clear();
                for (int64_t i : idx) buf.push_back(x[i]);
                mu = exact_sum(buf) / static_cast<double>(n);
                for (auto& v : buf) v = (v - mu) * (v - mu);
                sigma = std::sqrt(exact_sum(buf) / static_cast<double>(n - 1));
            }
            for (int64_t i : idx) o[i] = mode == "mean_norm" ? x[i] - mu : (x[i] - mu) / (sigma + eps);
        }
    }
    return out;
}

// No NaN or infinity in x[0:n]: no value with an all-ones exponent (integer test on the bits: it vectorises).
// U is the same-sized unsigned integer, E the exponent mask of D.
template <class D, class U, U E>
bool all_finite_bits(const D* x, int64_t n) {
    static_assert(sizeof(D) == sizeof(U), "U must have D's size");
    U bad = 0;
    for (int64_t j = 0; j < n; ++j) {
        U bits;
        std::memcpy(&bits, x + j, sizeof(bits));
        bad |= static_cast<U>((bits & E) == E);
    }
    return bad == 0;
}

inline bool all_finite(const float* x, int64_t n) { return all_finite_bits<float, uint32_t, 0x7F800000u>(x, n); }
inline bool all_finite(const double* x, int64_t n) {
    return all_finite_bits<double, uint64_t, 0x7FF0000000000000ull>(x, n);
}

// How one skill type's Δ enters the advantage of one sample's tokens (reference.token_advantages, per token):
// d = valid ? Δ : 0; normalised d = valid ? (d - μ) / (σ + ε) : 0; clipped; acc = acc + λ d.
struct Transform {
    double lam;
    bool valid, normalize;
    double mu, sd_eps;  // sd_eps = σ + ε
    bool has_clip;
    double clip;
};

template <class D>
void add_scaled(double* acc, const D* delta, int64_t n, const Transform& tf) {
    if (!tf.valid) {
        const double d = tf.has_clip ? std::min(std::max(0.0, -tf.clip), tf.clip) : 0.0;
        const double v = tf.lam * d;
        for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + v;
        return;
    }
    if (!tf.normalize && !tf.has_clip) {
        for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + tf.lam * static_cast<double>(delta[j]);
        return;
    }
    for (int64_t j = 0; j < n; ++j) {
        double d = static_cast<double>(delta[j]);
        if (tf.normalize) d = (d - tf.mu) / tf.sd_eps;
        if (tf.has_clip) d = std::min(std::max(d, -tf.clip), tf.clip);
        acc[j] = acc[j] + tf.lam * d;
    }
}

py::array_t<float> token_advantages(py::object outcome_o, py::object resp_lens_o, py::list deltas_o, py::list masks_o,
                                    py::list lambdas_o, bool normalize, py::object clip_o, double eps,
                                    py::object groups_o, py::object share_cap_o) {
    Kind ok;
    py::buffer_info oi = request("outcome_adv", outcome_o, {Kind::F32, Kind::F64}, &ok);
    const int64_t S = oi.shape[0];
    py::buffer_info ri = request("resp_lens", resp_lens_o, {Kind::I64}, nullptr, S);
    const std::vector<int64_t> rl(static_cast<const int64_t*>(ri.ptr), static_cast<const int64_t*>(ri.ptr) + S);
    for (int64_t s = 0; s < S; ++s) {
        if (rl[s] < 0) throw py::value_error("resp_lens[" + std::to_string(s) + "] is negative");
    }
    const size_t K = deltas_o.size();
    if (masks_o.size() != K || lambdas_o.size() != K) {
        throw py::value_error("deltas (" + std::to_string(K) + "), masks (" + std::to_string(masks_o.size()) +
                              ") and lambdas (" + std::to_string(lambdas_o.size()) + ") must have the same length");
    }
    bool has_clip = false;
    double clip = 0.0;
    if (!clip_o.is_none()) {
        try {
            clip = py::cast<double>(clip_o);
        } catch (py::cast_error&) {
            throw py::type_error("clip must be a number or None");
        }
        if (!(clip > 0)) throw py::value_error("clip=" + std::string(py::str(clip_o)) + " must be > 0 or None");
        has_clip = true;
    }
    if (!(eps > 0) || std::isinf(eps)) {
        throw py::value_error("eps=" + std::to_string(eps) + " must be finite and > 0");
    }
    // share_cap (algo.skill_share_cap): each group's skill mass at most cap x its outcome mass
    const bool has_cap = !share_cap_o.is_none();
    double cap = 0.0;
    std::vector<int64_t> group_of;
    if (has_cap) {
        try {
            cap = py::cast<double>(share_cap_o);
        } catch (py::cast_error&) {
            throw py::type_error("share_cap must be a number or None");
        }
        if (!(cap >= 0) || std::isinf(cap)) {
            throw py::value_error("share_cap=" + std::string(py::str(share_cap_o)) +
                                  " must be finite and >= 0, or None");
        }
        if (groups_o.is_none()) throw py::value_error("share_cap needs groups (the GRPO group of each sample)");
        py::buffer_info gi = request("groups", groups_o, {Kind::I64}, nullptr, S);
        group_of.assign(static_cast<const int64_t*>(gi.ptr), static_cast<const int64_t*>(gi.ptr) + S);
    }
    int64_t total = 0;
    for (int64_t s = 0; s < S; ++s) total += rl[s];
    std::vector<py::buffer_info> dinfo(K), minfo(K);
    std::vector<Kind> dkind(K);
    std::vector<double> lam(K);
    for (size_t k = 0; k < K; ++k) {
        const std::string i = "[" + std::to_string(k) + "]";
        dinfo[k] = request("deltas" + i, deltas_o[k], {Kind::F32, Kind::F64}, &dkind[k], total);
        minfo[k] = request("masks" + i, masks_o[k], {Kind::BOOL}, nullptr, S);
        try {
            lam[k] = py::cast<double>(lambdas_o[k]);
        } catch (py::cast_error&) {
            throw py::type_error("lambdas" + i + " must be a number");
        }
        if (!(lam[k] >= 0) || std::isinf(lam[k])) {
            throw py::value_error("lambdas" + i + "=" + std::string(py::str(lambdas_o[k])) +
                                  " must be finite and >= 0");
        }
    }
    std::vector<double> ob = to_doubles(oi, ok);
    auto out = new_array<float>(total);
    float* o = out.mutable_data();
    std::string error;
    {
        py::gil_scoped_release release;
        auto delta_at = [&](size_t k, int64_t t) -> double {
            return dkind[k] == Kind::F32 ? static_cast<double>(static_cast<const float*>(dinfo[k].ptr)[t])
                                         : static_cast<const double*>(dinfo[k].ptr)[t];
        };
        auto finite_at = [&](size_t k, int64_t t, int64_t n) {
            return dkind[k] == Kind::F32 ? all_finite(static_cast<const float*>(dinfo[k].ptr) + t, n)
                                         : all_finite(static_cast<const double*>(dinfo[k].ptr) + t, n);
        };
        // The first non-finite valid Δ (type by type, token by token, as the reference reports it), or "".
        auto first_non_finite = [&]() -> std::string {
            for (size_t k = 0; k < K; ++k) {
                const uint8_t* mask = static_cast<const uint8_t*>(minfo[k].ptr);
                for (int64_t s = 0, t = 0; s < S; t += rl[s], ++s) {
                    if (!mask[s] || finite_at(k, t, rl[s])) continue;
                    for (int64_t j = 0; j < rl[s]; ++j) {
                        if (!std::isfinite(delta_at(k, t + j))) {
                            return "deltas[" + std::to_string(k) + "][" + std::to_string(t + j) + "] is not finite";
                        }
                    }
                }
            }
            return "";
        };
        // normalize: exact mean / population std of each type's valid Δ (after checking them all)
        std::vector<double> mu(K, 0.0), sd(K, 0.0);
        std::vector<int64_t> count(K, 0);
        for (size_t k = 0; k < K; ++k) {
            const uint8_t* mask = static_cast<const uint8_t*>(minfo[k].ptr);
            for (int64_t s = 0; s < S; ++s) count[k] += mask[s] ? rl[s] : 0;
        }
        if (normalize) error = first_non_finite();
        for (size_t k = 0; k < K && normalize && error.empty(); ++k) {
            if (count[k] == 0) continue;
            const uint8_t* mask = static_cast<const uint8_t*>(minfo[k].ptr);
            ExactSum sum, sq;
            for (int64_t s = 0, t = 0; s < S; t += rl[s], ++s) {
                for (int64_t j = 0; mask[s] && j < rl[s]; ++j) sum.add(delta_at(k, t + j));
            }
            mu[k] = sum.result() / static_cast<double>(count[k]);
            for (int64_t s = 0, t = 0; s < S; t += rl[s], ++s) {
                for (int64_t j = 0; mask[s] && j < rl[s]; ++j) {
                    const double x = delta_at(k, t + j) - mu[k];
                    sq.add(x * x);
                }
            }
            sd[k] = std::sqrt(sq.result() / static_cast<double>(count[k]));
        }
        // A = A_out + sum_k lambda_k * Delta'_k, in the reference's operation order (per token: start from A_out,
        // add the types in order), vectorised over each sample's tokens in blocks. Without normalize the
        // finiteness check rides along (every type, λ = 0 included); a failure is then located exactly.
        if (error.empty()) {
            std::vector<int64_t> start(S + 1, 0);
            for (int64_t s = 0; s < S; ++s) start[s + 1] = start[s] + rl[s];
            std::atomic<bool> bad{false};
            // with the share cap the skill term is accumulated alone (from 0) into `skill`, then scaled per group
            std::vector<double> skill(has_cap ? static_cast<size_t>(total) : 0);
            parallel_for(S, pick_threads(total), [&](int64_t lo, int64_t hi) {
                constexpr int64_t kBlock = 512;
                double acc[kBlock];
                bool ok = true;
                for (int64_t s = lo; s < hi; ++s) {
                    for (int64_t b0 = start[s]; b0 < start[s + 1]; b0 += kBlock) {
                        const int64_t n = std::min(kBlock, start[s + 1] - b0);
                        for (int64_t j = 0; j < n; ++j) acc[j] = has_cap ? 0.0 : ob[s];
                        for (size_t k = 0; k < K; ++k) {
                            const bool valid = static_cast<const uint8_t*>(minfo[k].ptr)[s] != 0;
                            if (!normalize && valid) ok &= finite_at(k, b0, n);
                            if (lam[k] == 0.0) continue;
                            Transform tf{lam[k], valid, normalize && count[k] > 0, mu[k], sd[k] + eps, has_clip,
                                         clip};
                            if (dkind[k] == Kind::F32) {
                                add_scaled(acc, static_cast<const float*>(dinfo[k].ptr) + b0, n, tf);
                            } else {
                                add_scaled(acc, static_cast<const double*>(dinfo[k].ptr) + b0, n, tf);
                            }
                        }
                        if (has_cap) {
                            std::copy(acc, acc + n, skill.begin() + b0);
                        } else {
                            for (int64_t j = 0; j < n; ++j) o[b0 + j] = static_cast<float>(acc[j]);
                        }
                    }
                }
                if (!ok) bad = true;
            });
            if (bad) error = first_non_finite();
            if (has_cap && error.empty()) {
                // per group: O = sum |A_out| and K = sum |skill| over its tokens (exact sums), f = min(1, cap O / K)
                std::unordered_map<int64_t, std::pair<ExactSum, ExactSum>> mass;
                for (int64_t s = 0; s < S; ++s) {
                    auto& m = mass[group_of[s]];
                    for (int64_t t = start[s]; t < start[s + 1]; ++t) {
                        m.first.add(std::fabs(ob[s]));
                        m.second.add(std::fabs(skill[t]));
                    }
                }
                std::unordered_map<int64_t, double> scale;
                for (auto& kv : mass) {
                    const double o_mass = kv.second.first.result(), k_mass = kv.second.second.result();
                    scale[kv.first] = k_mass > cap * o_mass ? cap * o_mass / k_mass : 1.0;
                }
                for (int64_t s = 0; s < S; ++s) {
                    const double f = scale[group_of[s]];
                    for (int64_t t = start[s]; t < start[s + 1]; ++t) o[t] = static_cast<float>(ob[s] + skill[t] * f);
                }
            }
        }
    }
    if (!error.empty()) throw py::value_error(error);
    return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.def("clear_buffer_pool", []() { return BufferPool::get().clear(); },
          "Free the cached output buffers; returns the number of bytes freed.");
    m.def("buffer_pool_bytes", []() { return BufferPool::get().cached(); }, "Bytes of output buffers cached.");
    m.doc() = "opid-mega batch builder: fork-layout scoring batches, plain training batches, token advantages";
    m.def("build_batches", &build_batches, py::arg("tokens"), py::arg("ctx_offsets"), py::arg("resp_lens"),
          py::arg("sample_offsets"), py::arg("budget"), py::arg("num_ranks") = 1, py::arg("plain") = false,
          py::arg("share_prompts") = true, py::arg("max_group_tokens") = py::none(),
          py::arg("min_micro_batches") = 1, py::arg("token_values") = py::none(),
          "Fork (or plain) layout + packing into micro-batches; flat outputs as opid_mega.batching.reference.");
    m.def("plan_micro_batches", &plan_micro_batches, py::arg("group_tokens"), py::arg("budget"),
          py::arg("num_ranks") = 1, py::arg("min_micro_batches") = 1,
          "Greedy longest-first packing of groups; returns (micro_batch_of_group, micro_batches_per_rank).");
    m.def("outcome_advantage", &outcome_advantage, py::arg("scores"), py::arg("group_ids"),
          py::arg("mode") = "mean_std_norm", py::arg("eps") = 1e-6, "GRPO outcome advantage (float64).");
    m.def("token_advantages", &token_advantages, py::arg("outcome_adv"), py::arg("resp_lens"), py::arg("deltas"),
          py::arg("masks"), py::arg("lambdas"), py::arg("normalize") = false, py::arg("clip") = py::none(),
          py::arg("eps") = 1e-6, py::arg("groups") = py::none(), py::arg("share_cap") = py::none(),
          "Per response token A = A_out + sum_k lambda_k * Delta'_k (float32); share_cap: per group, the skill "
          "term at most share_cap x the outcome term.");
}
