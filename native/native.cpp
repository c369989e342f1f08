// overmind_lab._native: byte-moving helpers for the model cache.
//
// Plain C++17 over the Python buffer protocol; nothing here links libtorch, so a torch
// upgrade never breaks this module. Every function obtains its buffer pointers while
// holding the GIL, releases the GIL for the heavy work (copies, memcmp, page faults),
// and releases the buffers again with the GIL held.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#if defined(__linux__) && !defined(MADV_POPULATE_READ)
#define MADV_POPULATE_READ 22  // Linux >= 5.14; older headers lack the name
#endif

namespace py = pybind11;

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
// Work is cut into chunks of at most this size so one huge tensor still uses every thread.
constexpr std::size_t kMaxChunk = 8 * kMiB;
constexpr std::size_t kMinChunk = 1 * kMiB;
// Below this total, threads cost more than they save: work on the calling thread.
constexpr std::size_t kSerialBelow = 4 * kMiB;
constexpr int kDefaultMaxThreads = 8;
constexpr int kThreadCap = 256;

// ---------------------------------------------------------------------------------------
// Buffers

// Re-raise the pending Python exception with `context: ` in front of its message,
// keeping its type (TypeError, BufferError, ...).
[[noreturn]] void rethrow_with_context(const std::string &context) {
    PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    std::string message = context;
    if (value != nullptr) {
        PyObject *text = PyObject_Str(value);
        if (text != nullptr) {
            const char *utf8 = PyUnicode_AsUTF8(text);
            if (utf8 != nullptr) {
                message += ": ";
                message += utf8;
            }
            Py_DECREF(text);
        }
        PyErr_Clear();
    }
    PyErr_SetString(type != nullptr ? type : PyExc_BufferError, message.c_str());
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    throw py::error_already_set();
}

// RAII holder of a Py_buffer. Construct and destroy it with the GIL held.
class Buffer {
  public:
    Buffer(py::handle obj, int flags, const std::string &what) {
        if (!PyObject_CheckBuffer(obj.ptr())) {
            throw py::type_error(what + " must support the buffer protocol (bytes, bytearray, "
                                        "memoryview, mmap, numpy array...), got " +
                                 std::string(Py_TYPE(obj.ptr())->tp_name));
        }
        if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
            rethrow_with_context(what);
        }
        held_ = true;
    }
    Buffer(const Buffer &) = delete;
    Buffer &operator=(const Buffer &) = delete;
    ~Buffer() {
        if (held_) {
            PyBuffer_Release(&view_);
        }
    }

    char *data() const { return static_cast<char *>(view_.buf); }
    std::size_t size() const { return static_cast<std::size_t>(view_.len); }

  private:
    Py_buffer view_{};
    bool held_ = false;
};

// ---------------------------------------------------------------------------------------
// Threads

int resolve_threads(int threads) {
    if (threads < 0) {
        throw py::value_error("threads must be >= 0 (0 = automatic), got " +
                              std::to_string(threads));
    }
    if (threads == 0) {
        unsigned hw = std::thread::hardware_concurrency();
        if (hw == 0) {
            hw = 1;
        }
        return static_cast<int>(std::min<unsigned>(hw, kDefaultMaxThreads));
    }
    return std::min(threads, kThreadCap);
}

// Chunk size for `total` bytes over `threads` workers: about one chunk per thread,
// clamped to [kMinChunk, kMaxChunk].
std::size_t chunk_size(std::size_t total, int threads) {
    std::size_t per = (total + static_cast<std::size_t>(threads) - 1) / static_cast<std::size_t>(threads);
    return std::clamp(per, kMinChunk, kMaxChunk);
}

// Runs fn(i) for every i in [0, ntasks) on up to `threads` threads, the calling thread
// included; tasks are handed out dynamically. fn must not throw. If the system refuses
// to start a thread, the threads already running (and the caller) do the rest.
template <class Fn>
void run_parallel(int threads, std::size_t ntasks, Fn &&fn) {
    if (ntasks == 0) {
        return;
    }
    std::atomic<std::size_t> next{0};
    auto worker = [&]() {
        for (std::size_t i = next.fetch_add(1, std::memory_order_relaxed); i < ntasks;
             i = next.fetch_add(1, std::memory_order_relaxed)) {
            fn(i);
        }
    };
    const std::size_t extra =
        std::min<std::size_t>(static_cast<std::size_t>(std::max(threads, 1)), ntasks) - 1;
    std::vector<std::thread> pool;
    pool.reserve(extra);
    for (std::size_t t = 0; t < extra; ++t) {
        try {
            pool.emplace_back(worker);
        } catch (const std::system_error &) {
            break;
        }
    }
    worker();
    for (auto &th : pool) {
        th.join();
    }
}

// ---------------------------------------------------------------------------------------
// equal

bool equal(py::handle a_obj, py::handle b_obj, int threads) {
    const int nthreads = resolve_threads(threads);
    Buffer a(a_obj, PyBUF_SIMPLE, "a");
    Buffer b(b_obj, PyBUF_SIMPLE, "b");
    if (a.size() != b.size()) {
        return false;
    }
    const std::size_t n = a.size();
    if (n == 0 || a.data() == b.data()) {
        return true;
    }
    const int workers = n < kSerialBelow ? 1 : nthreads;
    const std::size_t chunk = chunk_size(n, workers);
    const std::size_t ntasks = (n + chunk - 1) / chunk;
    std::atomic<bool> differ{false};
    {
        py::gil_scoped_release nogil;
        run_parallel(workers, ntasks, [&](std::size_t i) {
            if (differ.load(std::memory_order_relaxed)) {
                return;
            }
            const std::size_t off = i * chunk;
            const std::size_t len = std::min(chunk, n - off);
            if (std::memcmp(a.data() + off, b.data() + off, len) != 0) {
                differ.store(true, std::memory_order_relaxed);
            }
        });
    }
    return !differ.load();
}

// ---------------------------------------------------------------------------------------
// prefault

std::size_t page_size() {
#if defined(_SC_PAGESIZE)
    long ps = sysconf(_SC_PAGESIZE);
    if (ps > 0) {
        return static_cast<std::size_t>(ps);
    }
#endif
    return 4096;
}

// Reads one byte of every page in [lo, hi) (page-aligned); returns their sum so the
// reads are not optimized away (they are volatile anyway).
unsigned touch_pages(const char *lo, const char *hi, std::size_t ps) {
    unsigned sum = 0;
    for (const volatile char *p = lo; p < hi; p += ps) {
        sum += static_cast<unsigned char>(*p);
    }
    return sum;
}

std::string prefault(py::handle buf_obj, int threads, const std::string &method) {
    int mode;  // 0 = auto, 1 = populate only, 2 = touch only
    if (method == "auto") {
        mode = 0;
    } else if (method == "populate") {
        mode = 1;
    } else if (method == "touch") {
        mode = 2;
    } else {
        throw py::value_error("method must be 'auto', 'populate' or 'touch', got '" + method + "'");
    }
    const int nthreads = resolve_threads(threads);
    Buffer buf(buf_obj, PyBUF_SIMPLE, "buf");
    const std::size_t ps = page_size();
    const auto addr = reinterpret_cast<std::uintptr_t>(buf.data());
    const std::uintptr_t lo = addr & ~(static_cast<std::uintptr_t>(ps) - 1);
    const std::uintptr_t hi =
        buf.size() == 0 ? lo : ((addr + buf.size() + ps - 1) & ~(static_cast<std::uintptr_t>(ps) - 1));
    const std::size_t len = hi - lo;

    bool populate = false;
#if defined(__linux__)
    if (mode != 2) {
        // A zero-length call at an aligned address only validates the advice: EINVAL
        // means this kernel does not know MADV_POPULATE_READ (< 5.14).
        if (madvise(reinterpret_cast<void *>(lo), 0, MADV_POPULATE_READ) == 0) {
            populate = true;
        } else if (errno != EINVAL && errno != ENOSYS) {
            PyErr_SetFromErrno(PyExc_OSError);
            throw py::error_already_set();
        }
    }
#endif
    if (mode == 1 && !populate) {
        throw py::value_error("madvise(MADV_POPULATE_READ) is not supported by this kernel");
    }
    if (len == 0) {
        return populate ? "populate" : "touch";
    }

    const int workers = len < kSerialBelow ? 1 : nthreads;
    std::size_t chunk = chunk_size(len, workers);
    chunk = (chunk + ps - 1) / ps * ps;
    const std::size_t ntasks = (len + chunk - 1) / chunk;
    std::atomic<int> error{0};          // first fatal errno
    std::atomic<bool> touched{false};   // some range fell back to touching
    std::atomic<unsigned> sink{0};
    {
        py::gil_scoped_release nogil;
        run_parallel(workers, ntasks, [&](std::size_t i) {
            if (error.load(std::memory_order_relaxed) != 0) {
                return;
            }
            const char *p = reinterpret_cast<const char *>(lo) + i * chunk;
            const std::size_t n = std::min(chunk, len - i * chunk);
#if defined(__linux__)
            if (populate) {
                for (int attempt = 0; attempt < 8; ++attempt) {
                    if (madvise(const_cast<char *>(p), n, MADV_POPULATE_READ) == 0) {
                        return;
                    }
                    const int e = errno;
                    if (e == EINTR || e == EAGAIN) {
                        continue;
                    }
                    if (e == EINVAL || e == ENOSYS) {
                        break;  // incompatible mapping (e.g. VM_IO): read the pages instead
                    }
                    // EFAULT (e.g. past the end of a file), ENOMEM, EHWPOISON: reading the
                    // pages would crash the process, so report it instead.
                    int expected = 0;
                    error.compare_exchange_strong(expected, e);
                    return;
                }
                if (mode == 1) {
                    int expected = 0;
                    error.compare_exchange_strong(expected, EINVAL);
                    return;
                }
            }
#endif
            touched.store(true, std::memory_order_relaxed);
            sink.fetch_add(touch_pages(p, p + n, ps), std::memory_order_relaxed);
        });
    }
    if (const int e = error.load(); e != 0) {
        errno = e;
        PyErr_SetFromErrno(PyExc_OSError);
        throw py::error_already_set();
    }
    return populate && !touched.load() ? "populate" : "touch";
}

// ---------------------------------------------------------------------------------------
// address

std::uintptr_t address(py::handle buf_obj) {
    Buffer buf(buf_obj, PyBUF_FULL_RO, "buf");
    return reinterpret_cast<std::uintptr_t>(buf.data());
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() =
        "Native helpers of overmind-lab: prefaulting of "
        "mappings and byte comparison, all over Python buffers and with the GIL released "
        "for the heavy work. Does not link libtorch.";

    m.def("prefault", &prefault, py::arg("buf"), py::arg("threads") = 0,
          py::arg("method") = "auto",
          R"doc(prefault(buf, threads=0, method="auto") -> str

Make the pages of ``buf`` (widened to page boundaries) resident for reading, without
changing a byte. Uses ``madvise(MADV_POPULATE_READ)`` (Linux >= 5.14) and returns
``"populate"``; where the kernel does not support it, reads one byte per page and
returns ``"touch"``. ``method="populate"`` or ``"touch"`` forces one way (``"populate"``
raises ValueError where unsupported). OSError if the kernel cannot populate the range
(e.g. a file mapping past the end of its file). Runs without the GIL on up to
``threads`` threads (0 = min(CPU count, 8)).)doc");

    m.def("equal", &equal, py::arg("a"), py::arg("b"), py::arg("threads") = 0,
          R"doc(equal(a, b, threads=0) -> bool

True if the contiguous buffers ``a`` and ``b`` hold the same bytes (False if their sizes
differ). Parallel memcmp by chunks without the GIL on up to ``threads`` threads.)doc");

    m.def("address", &address, py::arg("buf"),
          R"doc(address(buf) -> int

The address of the first byte of ``buf`` (``Py_buffer.buf``), for provenance lookups
(which mapping a buffer lies in).)doc");
}
