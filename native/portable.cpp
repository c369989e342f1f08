// Note [Portable native module]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The wheel on a package index must run on older Linux systems than the one that built it
// (`make dist` repairs it to manylinux_2_28: glibc 2.28, libstdc++ of GCC 8, the baseline
// torch's own wheels use). GCC 11 and newer headers make every C++ module need two
// symbols that only newer systems have, although this module uses neither feature:
//
// - `__libc_single_threaded` (glibc 2.32): inline reference counting in libstdc++ reads
//   it to skip atomic operations while a process has one thread. Defined here, hidden
//   (this module only), as 0, "possibly multi-threaded": the inline code then always uses
//   atomics, which is correct in every process; glibc's own variable is untouched.
// - `std::__throw_bad_array_new_length` (GLIBCXX_3.4.29, GCC 11): what
//   `std::allocator<T>::allocate` throws for a count whose byte size overflows. Defined
//   here, hidden, throwing `std::bad_alloc` (what older libstdc++ threw in that case).
// - `std::exception_ptr::_M_addref` and `_M_release` (CXXABI_1.3.13, GCC 11): the inline
//   copy constructor and destructor of `std::exception_ptr` (pybind11 copies one when it
//   translates a C++ exception) call them; before GCC 11 those two were out of line, and
//   every libstdc++ since GCC 4.4 still exports them (CXXABI_1.3.3). Defined here, hidden,
//   through the exported ones, bound by version (`.symver`, so that they can never bind
//   to an inline copy in this module and recurse): a copy made and never destroyed adds
//   one reference; a copy destroyed drops one, and frees the exception at zero.
//
// Both are private to this shared object (hidden visibility): nothing else in a process
// sees them. `tests/test_native.py` runs the module; `tests/test_install.py` checks the
// symbol versions the repaired wheel needs.
#include <cstddef>  // defines __GLIBCXX__ when the library is libstdc++

#if defined(__linux__) && defined(__GLIBCXX__)
namespace std {
[[noreturn]] void __throw_bad_alloc();

[[noreturn]] __attribute__((visibility("hidden"))) void __throw_bad_array_new_length() {
    __throw_bad_alloc();
}
}  // namespace std

extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

void overmind_exception_ptr_copy(void** self, void* const* other) noexcept;
void overmind_exception_ptr_destroy(void** self) noexcept;
__asm__(".symver overmind_exception_ptr_copy,"
        "_ZNSt15__exception_ptr13exception_ptrC1ERKS0_@CXXABI_1.3.3");
__asm__(".symver overmind_exception_ptr_destroy,"
        "_ZNSt15__exception_ptr13exception_ptrD1Ev@CXXABI_1.3.3");

// std::__exception_ptr::exception_ptr::_M_addref() and _M_release(): `self` is `this`,
// whose only member is the pointer to the exception object (never null here: the inline
// callers check it).
__attribute__((visibility("hidden"))) void overmind_exception_ptr_addref(void** self) noexcept
    __asm__("_ZNSt15__exception_ptr13exception_ptr9_M_addrefEv");
__attribute__((visibility("hidden"))) void overmind_exception_ptr_release(void** self) noexcept
    __asm__("_ZNSt15__exception_ptr13exception_ptr10_M_releaseEv");

void overmind_exception_ptr_addref(void** self) noexcept {
    void* reference = nullptr;
    overmind_exception_ptr_copy(&reference, self);  // kept: one more reference
}

void overmind_exception_ptr_release(void** self) noexcept {
    void* reference = *self;
    overmind_exception_ptr_destroy(&reference);  // one reference less
}
}
#endif
