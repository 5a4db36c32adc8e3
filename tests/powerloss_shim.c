/* The power-loss double's recorder: an LD_PRELOAD shim that logs every file operation a process makes under
 * one directory, so tests/powerloss.py can rebuild what a disk would hold after a power cut.
 *
 * SQLite and libgit2 write from C, so the seam is the C library's system-call wrappers: open/creat/mkstemp
 * (which create), write/pwrite/writev/pwritev/sendfile/copy_file_range (data, logged with the bytes written),
 * ftruncate/truncate/fallocate, rename/unlink/rmdir/mkdir/link (names), fsync/fdatasync/sync/syncfs.
 * Each operation is performed and then logged under a lock (a mutex between threads, an flock on the log
 * between processes), so the log's order is the order the kernel saw, and a test that takes the same flock
 * knows no process is between doing an operation and logging it. A caller's fsync returns only after its
 * record is in the log: whatever a client was told after that can be compared with log positions.
 *
 * Environment: POWERLOSS_ROOT (absolute, no trailing slash) = the directory watched; POWERLOSS_LOG = the log.
 * Files are identified by inode (fstat/lstat), so renames and fds opened by any route are followed.
 * Build: gcc -shared -fPIC -O1 -o powerloss.so powerloss_shim.c -ldl
 *
 * Record: "<c B H I Q Q Q q Q I I" = op, flags, 0, pid, ino, ino2, ino3, off, len, len(path1), len(path2),
 * then path1, path2 and len bytes of data.  Ops: C create (ino2 = parent; flag 2 = a directory, flag 4 = a
 * symlink to path2),
 * W write (flag 1 = the fd is O_SYNC/O_DSYNC), Z size set (off), E size at least (off), S fsync/fdatasync,
 * Y sync/syncfs (everything), R rename (ino2 = old parent, ino3 = new parent), U unlink/rmdir (ino2 = parent),
 * L link (ino2 = new parent), X something the model cannot follow (path1 says what). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#pragma pack(push, 1)
struct rec {
    char op;
    uint8_t flags;
    uint16_t zero;
    uint32_t pid;
    uint64_t ino, ino2, ino3;
    int64_t off;
    uint64_t len;
    uint32_t p1len, p2len;
};
#pragma pack(pop)

static char root[PATH_MAX];
static size_t root_len;
static char log_path[PATH_MAX];
static int log_fd = -1;
static pid_t log_pid;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

#define REAL(ret, name, ...) static ret (*real_##name)(__VA_ARGS__)
REAL(int, open, const char *, int, ...);
REAL(int, open64, const char *, int, ...);
REAL(int, openat, int, const char *, int, ...);
REAL(int, openat64, int, const char *, int, ...);
REAL(int, creat, const char *, mode_t);
REAL(int, creat64, const char *, mode_t);
REAL(int, mkstemp, char *);
REAL(int, mkstemp64, char *);
REAL(int, mkostemp, char *, int);
REAL(int, mkostemp64, char *, int);
REAL(int, mkstemps, char *, int);
REAL(int, mkostemps, char *, int, int);
REAL(ssize_t, write, int, const void *, size_t);
REAL(ssize_t, pwrite, int, const void *, size_t, off_t);
REAL(ssize_t, pwrite64, int, const void *, size_t, off_t);
REAL(ssize_t, writev, int, const struct iovec *, int);
REAL(ssize_t, pwritev, int, const struct iovec *, int, off_t);
REAL(ssize_t, pwritev64, int, const struct iovec *, int, off_t);
REAL(ssize_t, pwritev2, int, const struct iovec *, int, off_t, int);
REAL(ssize_t, pwritev64v2, int, const struct iovec *, int, off_t, int);
REAL(ssize_t, sendfile, int, int, off_t *, size_t);
REAL(ssize_t, sendfile64, int, int, off_t *, size_t);
REAL(ssize_t, copy_file_range, int, off_t *, int, off_t *, size_t, unsigned int);
REAL(int, ftruncate, int, off_t);
REAL(int, ftruncate64, int, off_t);
REAL(int, truncate, const char *, off_t);
REAL(int, truncate64, const char *, off_t);
REAL(int, fallocate, int, int, off_t, off_t);
REAL(int, fallocate64, int, int, off_t, off_t);
REAL(int, posix_fallocate, int, off_t, off_t);
REAL(int, posix_fallocate64, int, off_t, off_t);
REAL(int, fsync, int);
REAL(int, fdatasync, int);
REAL(void, sync, void);
REAL(int, syncfs, int);
REAL(int, rename, const char *, const char *);
REAL(int, renameat, int, const char *, int, const char *);
REAL(int, renameat2, int, const char *, int, const char *, unsigned int);
REAL(int, unlink, const char *);
REAL(int, unlinkat, int, const char *, int);
REAL(int, rmdir, const char *);
REAL(int, mkdir, const char *, mode_t);
REAL(int, mkdirat, int, const char *, mode_t);
REAL(int, link, const char *, const char *);
REAL(int, linkat, int, const char *, int, const char *, int);
REAL(int, symlink, const char *, const char *);
REAL(int, symlinkat, const char *, int, const char *);

static void child_after_fork(void) {
    pthread_mutex_init(&mu, NULL);
    log_fd = -1;  /* the parent's open file description shares its flock: the child opens its own */
}

__attribute__((constructor)) static void init(void) {
#define LOAD(name) real_##name = dlsym(RTLD_NEXT, #name)
    LOAD(open); LOAD(open64); LOAD(openat); LOAD(openat64);
    LOAD(creat); LOAD(creat64); LOAD(mkstemp); LOAD(mkstemp64); LOAD(mkostemp);
    LOAD(mkostemp64); LOAD(mkstemps); LOAD(mkostemps); LOAD(write); LOAD(pwrite); LOAD(pwrite64); LOAD(writev);
    LOAD(pwritev); LOAD(pwritev64); LOAD(pwritev2); LOAD(pwritev64v2); LOAD(sendfile); LOAD(sendfile64);
    LOAD(copy_file_range); LOAD(ftruncate); LOAD(ftruncate64); LOAD(truncate); LOAD(truncate64); LOAD(fallocate);
    LOAD(fallocate64); LOAD(posix_fallocate); LOAD(posix_fallocate64); LOAD(fsync); LOAD(fdatasync); LOAD(sync);
    LOAD(syncfs); LOAD(rename); LOAD(renameat); LOAD(renameat2); LOAD(unlink); LOAD(unlinkat); LOAD(rmdir);
    LOAD(mkdir); LOAD(mkdirat); LOAD(link); LOAD(linkat); LOAD(symlink); LOAD(symlinkat);
#undef LOAD
    const char *r = getenv("POWERLOSS_ROOT"), *l = getenv("POWERLOSS_LOG");
    if (r && l && strlen(r) < sizeof root && strlen(l) < sizeof log_path) {
        strcpy(root, r);
        root_len = strlen(root);
        strcpy(log_path, l);
    }
    pthread_atfork(NULL, NULL, child_after_fork);
}

static int under_root(const char *path) {
    return root_len && strncmp(path, root, root_len) == 0 && (path[root_len] == '/' || path[root_len] == 0);
}

/* The absolute path of name relative to dirfd (no symlink resolution; the daemon passes clean paths). */
static int abs_path(int dirfd, const char *name, char *out) {
    if (!name) return -1;
    if (name[0] == '/') {
        if (strlen(name) >= PATH_MAX) return -1;
        strcpy(out, name);
        return 0;
    }
    char base[PATH_MAX];
    if (dirfd == AT_FDCWD) {
        if (!getcwd(base, sizeof base)) return -1;
    } else {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, base, sizeof base - 1);
        if (n < 0) return -1;
        base[n] = 0;
    }
    const char *rest = name;
    while (rest[0] == '.' && rest[1] == '/') rest += 2;
    if (strlen(base) + 1 + strlen(rest) >= PATH_MAX) return -1;
    sprintf(out, "%s/%s", base, rest);
    return 0;
}

static int fd_path(int fd, char *out) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, out, PATH_MAX - 1);
    if (n < 0) return -1;
    out[n] = 0;
    return 0;
}

/* A file or directory under the root, by fd: its inode in *ino (0 if not ours). */
static uint64_t fd_ours(int fd, char *path) {
    struct stat st;
    if (!root_len || fd < 0 || fstat(fd, &st) != 0) return 0;
    if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) return 0;
    if (fd_path(fd, path) != 0 || !under_root(path)) return 0;
    return (uint64_t)st.st_ino;
}

static uint64_t path_ino(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static uint64_t parent_ino(const char *path) {
    char dir[PATH_MAX];
    strcpy(dir, path);
    char *slash = strrchr(dir, '/');
    if (!slash) return 0;
    if (slash == dir) slash[1] = 0; else *slash = 0;
    return path_ino(dir);
}

static void lock(void) {
    pthread_mutex_lock(&mu);
    if (log_fd < 0 || log_pid != getpid()) {
        int (*op)(const char *, int, ...) = real_open64 ? real_open64 : real_open;
        log_fd = op(log_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
        log_pid = getpid();
    }
    if (log_fd >= 0) flock(log_fd, LOCK_EX);
}

static void unlock(void) {
    if (log_fd >= 0) flock(log_fd, LOCK_UN);
    pthread_mutex_unlock(&mu);
}

/* One record in one write (O_APPEND keeps records whole between processes). Called with the lock held. */
static void emit(char op, uint8_t flags, uint64_t ino, uint64_t ino2, uint64_t ino3, int64_t off, const char *p1,
                 const char *p2, const struct iovec *data, int ndata, uint64_t len) {
    if (log_fd < 0) return;
    struct rec h = {op, flags, 0, (uint32_t)getpid(), ino, ino2, ino3, off, len, p1 ? strlen(p1) : 0,
                    p2 ? strlen(p2) : 0};
    size_t total = sizeof h + h.p1len + h.p2len + len;
    char *buf = malloc(total), *p = buf;
    if (!buf) abort();
    memcpy(p, &h, sizeof h); p += sizeof h;
    if (h.p1len) { memcpy(p, p1, h.p1len); p += h.p1len; }
    if (h.p2len) { memcpy(p, p2, h.p2len); p += h.p2len; }
    uint64_t left = len;
    for (int i = 0; i < ndata && left; i++) {
        size_t n = data[i].iov_len < left ? data[i].iov_len : left;
        memcpy(p, data[i].iov_base, n); p += n; left -= n;
    }
    size_t done = 0;
    while (done < total) {
        ssize_t n = real_write(log_fd, buf + done, total - done);
        if (n < 0) { if (errno == EINTR) continue; abort(); }
        done += (size_t)n;
    }
    free(buf);
}

static void emit_simple(char op, uint8_t flags, uint64_t ino, uint64_t ino2, uint64_t ino3, int64_t off,
                        const char *p1, const char *p2) {
    emit(op, flags, ino, ino2, ino3, off, p1, p2, NULL, 0, 0);
}

/* --- creating and opening ---------------------------------------------------------------------------------- */

static int after_open(int fd, const char *path, int flags, int existed) {
    if (fd < 0) return fd;
    uint64_t ino = path_ino(path);
    struct stat st;
    if (fstat(fd, &st) == 0) ino = (uint64_t)st.st_ino;
    if (!existed) emit_simple('C', 0, ino, parent_ino(path), 0, 0, path, NULL);
    else if (flags & O_TRUNC && (flags & O_ACCMODE) != O_RDONLY) emit_simple('Z', 0, ino, 0, 0, 0, path, NULL);
    return fd;
}

typedef int (*open_fn)(const char *, int, ...);
typedef int (*openat_fn)(int, const char *, int, ...);

/* Exactly one of pfn (open-like) and afn (openat-like) is given. */
static int do_open(open_fn pfn, openat_fn afn, int dirfd, const char *name, int flags, mode_t mode) {
    char path[PATH_MAX];
    if (!root_len || !(flags & (O_CREAT | O_TRUNC)) || abs_path(afn ? dirfd : AT_FDCWD, name, path) != 0
        || !under_root(path))
        return afn ? afn(dirfd, name, flags, mode) : pfn(name, flags, mode);
    lock();
    int existed = path_ino(path) != 0;
    int fd = afn ? afn(dirfd, name, flags, mode) : pfn(name, flags, mode);
    int saved = errno;
    after_open(fd, path, flags, existed);
    unlock();
    errno = saved;
    return fd;
}

#define MODE_ARG(flags) mode_t mode = 0; \
    if ((flags) & (O_CREAT | __O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }

int open(const char *p, int flags, ...) { MODE_ARG(flags); return do_open(real_open, NULL, 0, p, flags, mode); }
int open64(const char *p, int flags, ...) { MODE_ARG(flags); return do_open(real_open64, NULL, 0, p, flags, mode); }
int openat(int d, const char *p, int flags, ...) { MODE_ARG(flags); return do_open(NULL, real_openat, d, p, flags, mode); }
int openat64(int d, const char *p, int flags, ...) {
    MODE_ARG(flags);
    return do_open(NULL, real_openat64, d, p, flags, mode);
}
int __open_2(const char *p, int flags) { return do_open(real_open, NULL, 0, p, flags, 0); }
int __open64_2(const char *p, int flags) { return do_open(real_open64, NULL, 0, p, flags, 0); }
int __openat_2(int d, const char *p, int flags) { return do_open(NULL, real_openat, d, p, flags, 0); }
int __openat64_2(int d, const char *p, int flags) { return do_open(NULL, real_openat64, d, p, flags, 0); }
int creat(const char *p, mode_t m) { return do_open(real_open, NULL, 0, p, O_CREAT | O_WRONLY | O_TRUNC, m); }
int creat64(const char *p, mode_t m) { return do_open(real_open64, NULL, 0, p, O_CREAT | O_WRONLY | O_TRUNC, m); }

/* mkstemp and friends open inside the C library, out of reach: log the file they made. */
static int after_mkstemp(int fd, const char *tmpl) {
    char path[PATH_MAX];
    if (fd < 0 || !root_len || abs_path(AT_FDCWD, tmpl, path) != 0 || !under_root(path)) return fd;
    int saved = errno;
    lock();
    after_open(fd, path, O_CREAT, 0);
    unlock();
    errno = saved;
    return fd;
}

int mkstemp(char *t) { return after_mkstemp(real_mkstemp(t), t); }
int mkstemp64(char *t) { return after_mkstemp(real_mkstemp64(t), t); }
int mkostemp(char *t, int f) { return after_mkstemp(real_mkostemp(t, f), t); }
int mkostemp64(char *t, int f) { return after_mkstemp(real_mkostemp64(t, f), t); }
int mkstemps(char *t, int s) { return after_mkstemp(real_mkstemps(t, s), t); }
int mkostemps(char *t, int s, int f) { return after_mkstemp(real_mkostemps(t, s, f), t); }

/* --- data ---------------------------------------------------------------------------------------------------- */

static uint8_t sync_flag(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl >= 0 && (fl & (O_SYNC | O_DSYNC)) ? 1 : 0;
}

/* off < 0: the write went to the fd's position, which it advanced past the data. */
#define DATA_OP(call, fd, off_expr, iov, n_iov)                                                        \
    char path[PATH_MAX];                                                                                \
    uint64_t ino = fd_ours(fd, path);                                                                   \
    if (!ino) return call;                                                                              \
    lock();                                                                                             \
    ssize_t r = call;                                                                                   \
    int saved = errno;                                                                                  \
    if (r > 0) {                                                                                        \
        int64_t at = (off_expr);                                                                        \
        if (at < 0) at = (int64_t)lseek(fd, 0, SEEK_CUR) - r;                                           \
        emit('W', sync_flag(fd), ino, 0, 0, at, path, NULL, iov, n_iov, (uint64_t)r);                   \
    }                                                                                                   \
    unlock();                                                                                           \
    errno = saved;                                                                                      \
    return r;

ssize_t write(int fd, const void *b, size_t n) {
    struct iovec v = {(void *)b, n};
    DATA_OP(real_write(fd, b, n), fd, -1, &v, 1)
}
ssize_t pwrite(int fd, const void *b, size_t n, off_t o) {
    struct iovec v = {(void *)b, n};
    DATA_OP(real_pwrite(fd, b, n, o), fd, o, &v, 1)
}
ssize_t pwrite64(int fd, const void *b, size_t n, off_t o) {
    struct iovec v = {(void *)b, n};
    DATA_OP(real_pwrite64(fd, b, n, o), fd, o, &v, 1)
}
ssize_t writev(int fd, const struct iovec *v, int c) { DATA_OP(real_writev(fd, v, c), fd, -1, v, c) }
ssize_t pwritev(int fd, const struct iovec *v, int c, off_t o) { DATA_OP(real_pwritev(fd, v, c, o), fd, o, v, c) }
ssize_t pwritev64(int fd, const struct iovec *v, int c, off_t o) { DATA_OP(real_pwritev64(fd, v, c, o), fd, o, v, c) }
ssize_t pwritev2(int fd, const struct iovec *v, int c, off_t o, int f) {
    DATA_OP(real_pwritev2(fd, v, c, o, f), fd, o, v, c)
}
ssize_t pwritev64v2(int fd, const struct iovec *v, int c, off_t o, int f) {
    DATA_OP(real_pwritev64v2(fd, v, c, o, f), fd, o, v, c)
}

/* Kernel-side copies: the bytes are read back from the source after the copy. */
static ssize_t copy_op(int out, int in, off_t *in_off, off_t *out_off, size_t n, int kind, unsigned int flags) {
    char path[PATH_MAX];
    uint64_t ino = fd_ours(out, path);
    if (!ino) {
        if (kind == 0) return real_sendfile(out, in, in_off, n);
        return real_copy_file_range(in, in_off, out, out_off, n, flags);
    }
    lock();
    off_t src_at = in_off ? *in_off : lseek(in, 0, SEEK_CUR);
    off_t dst_at = out_off ? *out_off : -1;
    ssize_t r = kind == 0 ? real_sendfile(out, in, in_off, n) : real_copy_file_range(in, in_off, out, out_off, n, flags);
    int saved = errno;
    if (r > 0) {
        if (dst_at < 0) dst_at = lseek(out, 0, SEEK_CUR) - r;
        char *buf = malloc((size_t)r);
        if (!buf || pread(in, buf, (size_t)r, src_at) != r) abort();
        struct iovec v = {buf, (size_t)r};
        emit('W', sync_flag(out), ino, 0, 0, dst_at, path, NULL, &v, 1, (uint64_t)r);
        free(buf);
    }
    unlock();
    errno = saved;
    return r;
}

ssize_t sendfile(int out, int in, off_t *o, size_t n) { return copy_op(out, in, o, NULL, n, 0, 0); }
ssize_t sendfile64(int out, int in, off_t *o, size_t n) { return copy_op(out, in, o, NULL, n, 0, 0); }
ssize_t copy_file_range(int in, off_t *io, int out, off_t *oo, size_t n, unsigned int f) {
    return copy_op(out, in, io, oo, n, 1, f);
}

#define SIZE_OP(call, fd, op, size)                                                                     \
    char path[PATH_MAX];                                                                                \
    uint64_t ino = fd_ours(fd, path);                                                                   \
    if (!ino) return call;                                                                              \
    lock();                                                                                             \
    int r = call;                                                                                       \
    int saved = errno;                                                                                  \
    if (r == 0) emit_simple(op, 0, ino, 0, 0, (int64_t)(size), path, NULL);                             \
    unlock();                                                                                           \
    errno = saved;                                                                                      \
    return r;

int ftruncate(int fd, off_t n) { SIZE_OP(real_ftruncate(fd, n), fd, 'Z', n) }
int ftruncate64(int fd, off_t n) { SIZE_OP(real_ftruncate64(fd, n), fd, 'Z', n) }
int posix_fallocate(int fd, off_t o, off_t n) { SIZE_OP(real_posix_fallocate(fd, o, n), fd, 'E', o + n) }
int posix_fallocate64(int fd, off_t o, off_t n) { SIZE_OP(real_posix_fallocate64(fd, o, n), fd, 'E', o + n) }
int fallocate(int fd, int m, off_t o, off_t n) {
    if (m & ~FALLOC_FL_KEEP_SIZE) {  /* punching holes or zeroing ranges: not a pattern the model follows */
        char path[PATH_MAX];
        if (fd_ours(fd, path)) { lock(); emit_simple('X', 0, 0, 0, 0, 0, "fallocate mode", path); unlock(); }
        return real_fallocate(fd, m, o, n);
    }
    SIZE_OP(real_fallocate(fd, m, o, n), fd, 'E', m & FALLOC_FL_KEEP_SIZE ? 0 : o + n)
}
int fallocate64(int fd, int m, off_t o, off_t n) { return fallocate(fd, m, o, n); }

static int path_truncate(int (*fn)(const char *, off_t), const char *p, off_t n) {
    char path[PATH_MAX];
    if (!root_len || abs_path(AT_FDCWD, p, path) != 0 || !under_root(path)) return fn(p, n);
    lock();
    int r = fn(p, n), saved = errno;
    if (r == 0) emit_simple('Z', 0, path_ino(path), 0, 0, n, path, NULL);
    unlock();
    errno = saved;
    return r;
}
int truncate(const char *p, off_t n) { return path_truncate(real_truncate, p, n); }
int truncate64(const char *p, off_t n) { return path_truncate(real_truncate64, p, n); }

/* --- making durable ------------------------------------------------------------------------------------------ */

static int sync_op(int (*fn)(int), int fd) {
    char path[PATH_MAX];
    uint64_t ino = fd_ours(fd, path);
    if (!ino) return fn(fd);
    lock();
    int r = fn(fd), saved = errno;
    if (r == 0) emit_simple('S', 0, ino, 0, 0, 0, path, NULL);
    unlock();
    errno = saved;
    return r;
}

int fsync(int fd) { return sync_op(real_fsync, fd); }
int fdatasync(int fd) { return sync_op(real_fdatasync, fd); }
int syncfs(int fd) {
    if (!root_len) return real_syncfs(fd);
    lock();
    int r = real_syncfs(fd), saved = errno;
    if (r == 0) emit_simple('Y', 0, 0, 0, 0, 0, NULL, NULL);
    unlock();
    errno = saved;
    return r;
}
void sync(void) {
    if (!root_len) { real_sync(); return; }
    lock();
    real_sync();
    emit_simple('Y', 0, 0, 0, 0, 0, NULL, NULL);
    unlock();
}

/* --- names --------------------------------------------------------------------------------------------------- */

static int rename_op(int od, const char *o, int nd, const char *n, unsigned int flags, int kind) {
    char src[PATH_MAX], dst[PATH_MAX];
    int ours = root_len && abs_path(od, o, src) == 0 && abs_path(nd, n, dst) == 0 && (under_root(src) || under_root(dst));
    if (!ours) {
        if (kind == 0) return real_rename(o, n);
        if (kind == 1) return real_renameat(od, o, nd, n);
        return real_renameat2(od, o, nd, n, flags);
    }
    lock();
    uint64_t ino = path_ino(src), sp = parent_ino(src), dp = parent_ino(dst);
    int r = kind == 0 ? real_rename(o, n) : kind == 1 ? real_renameat(od, o, nd, n) : real_renameat2(od, o, nd, n, flags);
    int saved = errno;
    if (r == 0) {
        if (flags & ~1u) emit_simple('X', 0, 0, 0, 0, 0, "renameat2 flags", src);  /* RENAME_EXCHANGE etc. */
        else emit_simple('R', 0, ino, sp, dp, 0, src, dst);
    }
    unlock();
    errno = saved;
    return r;
}

int rename(const char *o, const char *n) { return rename_op(AT_FDCWD, o, AT_FDCWD, n, 0, 0); }
int renameat(int od, const char *o, int nd, const char *n) { return rename_op(od, o, nd, n, 0, 1); }
int renameat2(int od, const char *o, int nd, const char *n, unsigned int f) { return rename_op(od, o, nd, n, f, 2); }

static int unlink_op(int dirfd, const char *name, int flags, int kind) {
    char path[PATH_MAX];
    if (!root_len || abs_path(dirfd, name, path) != 0 || !under_root(path)) {
        if (kind == 0) return real_unlink(name);
        if (kind == 1) return real_rmdir(name);
        return real_unlinkat(dirfd, name, flags);
    }
    lock();
    uint64_t ino = path_ino(path), parent = parent_ino(path);
    int r = kind == 0 ? real_unlink(name) : kind == 1 ? real_rmdir(name) : real_unlinkat(dirfd, name, flags);
    int saved = errno;
    if (r == 0) emit_simple('U', 0, ino, parent, 0, 0, path, NULL);
    unlock();
    errno = saved;
    return r;
}

int unlink(const char *p) { return unlink_op(AT_FDCWD, p, 0, 0); }
int rmdir(const char *p) { return unlink_op(AT_FDCWD, p, 0, 1); }
int unlinkat(int d, const char *p, int f) { return unlink_op(d, p, f, 2); }

static int mkdir_op(int dirfd, const char *name, mode_t mode, int kind) {
    char path[PATH_MAX];
    if (!root_len || abs_path(dirfd, name, path) != 0 || !under_root(path))
        return kind == 0 ? real_mkdir(name, mode) : real_mkdirat(dirfd, name, mode);
    lock();
    int r = kind == 0 ? real_mkdir(name, mode) : real_mkdirat(dirfd, name, mode);
    int saved = errno;
    if (r == 0) emit_simple('C', 2, path_ino(path), parent_ino(path), 0, 0, path, NULL);
    unlock();
    errno = saved;
    return r;
}

int mkdir(const char *p, mode_t m) { return mkdir_op(AT_FDCWD, p, m, 0); }
int mkdirat(int d, const char *p, mode_t m) { return mkdir_op(d, p, m, 1); }

static int link_op(int od, const char *o, int nd, const char *n, int flags, int kind) {
    char src[PATH_MAX], dst[PATH_MAX];
    if (!root_len || abs_path(od, o, src) != 0 || abs_path(nd, n, dst) != 0 || !under_root(dst))
        return kind == 0 ? real_link(o, n) : real_linkat(od, o, nd, n, flags);
    lock();
    int r = kind == 0 ? real_link(o, n) : real_linkat(od, o, nd, n, flags);
    int saved = errno;
    if (r == 0) {
        if (!under_root(src)) emit_simple('X', 0, 0, 0, 0, 0, "link from outside", dst);
        else emit_simple('L', 0, path_ino(dst), parent_ino(dst), 0, 0, src, dst);
    }
    unlock();
    errno = saved;
    return r;
}

int link(const char *o, const char *n) { return link_op(AT_FDCWD, o, AT_FDCWD, n, 0, 0); }
int linkat(int od, const char *o, int nd, const char *n, int f) { return link_op(od, o, nd, n, f, 1); }

static int symlink_op(const char *target, int dirfd, const char *name, int kind) {
    char path[PATH_MAX];
    if (!root_len || abs_path(dirfd, name, path) != 0 || !under_root(path))
        return kind == 0 ? real_symlink(target, name) : real_symlinkat(target, dirfd, name);
    lock();
    int r = kind == 0 ? real_symlink(target, name) : real_symlinkat(target, dirfd, name);
    int saved = errno;
    if (r == 0) emit_simple('C', 4, path_ino(path), parent_ino(path), 0, 0, path, target);
    unlock();
    errno = saved;
    return r;
}

int symlink(const char *t, const char *p) { return symlink_op(t, AT_FDCWD, p, 0); }
int symlinkat(const char *t, int d, const char *p) { return symlink_op(t, d, p, 1); }
