/* gettid() for glibc before 2.30, which has only the system call. Rust's std
 * (1.95) links gettid@GLIBC_2.30, above the wheel's manylinux_2_28 floor:
 * scripts/setup-python links this into the extension and the CLI (zig's
 * glibc 2.28 has no gettid, so nothing else can). Hidden: never exported,
 * never interposing on the process's own libc. */
#define _GNU_SOURCE
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

__attribute__((visibility("hidden"))) pid_t gettid(void) {
    return (pid_t)syscall(SYS_gettid);
}
