//! Thin safe wrappers over the few Linux system calls the providers need:
//! eventfd, memfd + shared mmap, poll, unix SOCK_SEQPACKET sockets with
//! descriptor passing, interface addresses and link state, and signals.
//!
//! Every `unsafe` block carries a `// SAFETY:` justification.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn timeout_ms(t: Option<Duration>) -> libc::c_int {
    match t {
        None => -1,
        Some(d) => d.as_millis().min(i32::MAX as u128) as libc::c_int,
    }
}

/// A non-blocking eventfd used as a wake-up counter.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// Creates a new eventfd (non-blocking, close-on-exec).
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd has no memory-safety preconditions.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: fd was just returned by eventfd and is owned by nobody else.
        Ok(EventFd {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }
    /// Wraps an eventfd received from another process.
    pub fn from_owned(fd: OwnedFd) -> EventFd {
        EventFd { fd }
    }
    /// [`Self::new`], numbered out of the way of the application's
    /// descriptors ([`out_of_the_way`]): for one made per connection.
    pub fn new_high() -> io::Result<EventFd> {
        Ok(EventFd {
            fd: out_of_the_way(Self::new()?.fd),
        })
    }
    /// Adds one to the counter (wakes pollers).
    pub fn signal(&self) {
        signal_fd(self.fd.as_fd());
    }
    /// Resets the counter; returns whether it was non-zero. Never blocks,
    /// whatever the descriptor's file status flags are now: the eventfds of
    /// a region's doorbell and of a completion channel are handed to peers
    /// (other processes) so that they can signal them, and a peer can clear
    /// `O_NONBLOCK` on the open file description they share with us; a plain
    /// `read` of a counter at 0 would then hang this thread. The read asks
    /// for `RWF_NOWAIT` (`preadv2`), which the eventfd honours per call
    /// (Linux fs/eventfd.c `eventfd_read`: `IOCB_NOWAIT` as `O_NONBLOCK`).
    /// Kernels whose eventfd refuses the flag get a zero-timeout poll before
    /// a plain read: a hostile peer that also reads its copy between the two
    /// can still make that read wait.
    pub fn drain(&self) -> bool {
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        static NO_NOWAIT: AtomicBool = AtomicBool::new(false);
        let mut v: u64 = 0;
        let fd = self.fd.as_raw_fd();
        if !NO_NOWAIT.load(Relaxed) {
            let iov = libc::iovec {
                iov_base: (&mut v as *mut u64).cast(),
                iov_len: 8,
            };
            // SAFETY: one iovec of 8 bytes over a local u64, a valid eventfd;
            // offset -1: the file's own position (an eventfd has none).
            let r = unsafe { libc::preadv2(fd, &iov, 1, -1, libc::RWF_NOWAIT) };
            if r >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EOPNOTSUPP) {
                return r == 8 && v > 0;
            }
            NO_NOWAIT.store(true, Relaxed);
        }
        let ready = poll_one(self.fd.as_fd(), libc::POLLIN, Some(Duration::ZERO));
        if !matches!(ready, Ok(r) if r & libc::POLLIN != 0) {
            return false;
        }
        // SAFETY: reads 8 bytes into a local u64 from a valid eventfd.
        let r = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
        r == 8 && v > 0
    }
    /// Waits until readable or timeout, then drains; true if an event was consumed.
    pub fn wait(&self, timeout: Duration) -> io::Result<bool> {
        let r = poll_one(self.fd.as_fd(), libc::POLLIN, Some(timeout))?;
        Ok(r != 0 && self.drain())
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Writes 1 to an eventfd (errors such as counter overflow are ignored: the
/// fd stays readable, which is all a wake-up needs).
pub fn signal_fd(fd: BorrowedFd<'_>) {
    let v: u64 = 1;
    // SAFETY: writes 8 bytes from a local u64 to a valid descriptor.
    let _ = unsafe { libc::write(fd.as_raw_fd(), (&v as *const u64).cast(), 8) };
}

/// Polls one descriptor; returns revents (0 on timeout). EINTR counts as timeout.
pub fn poll_one(fd: BorrowedFd<'_>, events: i16, timeout: Option<Duration>) -> io::Result<i16> {
    let mut p = [(fd.as_raw_fd(), events, 0i16)];
    poll_raw(&mut p, timeout)?;
    Ok(p[0].2)
}

/// Polls several raw descriptors `(fd, events, revents)`; returns the count ready.
pub fn poll_raw(fds: &mut [(RawFd, i16, i16)], timeout: Option<Duration>) -> io::Result<usize> {
    let mut v: Vec<libc::pollfd> = fds
        .iter()
        .map(|&(fd, events, _)| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    // SAFETY: v is a valid array of v.len() pollfd structs for the duration of the call.
    let r = unsafe { libc::poll(v.as_mut_ptr(), v.len() as libc::nfds_t, timeout_ms(timeout)) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    for (slot, p) in fds.iter_mut().zip(&v) {
        slot.2 = p.revents;
    }
    Ok(r as usize)
}

/// A shared memory mapping of a memfd (`MAP_SHARED`), page aligned.
///
/// The mapping may be written concurrently by another process, so all
/// accessors copy bytes (no references into the mapping are handed out except
/// atomics) and every accessor checks bounds.
///
/// A mapping does not need its descriptor: [`SharedMem::close_fd`] drops it
/// once nobody needs it any more (it is only kept to hand it to a peer), and
/// [`SharedMem::map_peer`] and [`SharedMem::map_peer_range`] map a peer's
/// memfd (or one range of it) without keeping one.
#[derive(Debug)]
pub struct SharedMem {
    ptr: NonNull<u8>,
    len: usize,
    fd: Option<OwnedFd>,
}

// SAFETY: the mapping is plain shared memory; all access goes through bounds
// checked copies or atomics, so sharing the handle across threads is sound.
unsafe impl Send for SharedMem {}
// SAFETY: see above; no interior references with aliasing guarantees exist.
unsafe impl Sync for SharedMem {}

impl SharedMem {
    /// Creates a zeroed memfd of `len` bytes, seals its size (a process it
    /// is handed to can neither shrink it under our mapping, which would
    /// turn our next access into SIGBUS, nor grow it) and maps it.
    pub fn create(name: &str, len: usize) -> io::Result<SharedMem> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length memfd",
            ));
        }
        let cname = CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: cname is a valid NUL-terminated string.
        let fd = cvt(unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        })?;
        // SAFETY: fd is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on a valid fd.
        cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
        // SAFETY: F_ADD_SEALS on a valid memfd created with MFD_ALLOW_SEALING.
        cvt(unsafe {
            libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        })?;
        Self::map(fd)
    }

    /// Maps a memfd received from another process; its size comes from fstat
    /// so a lying peer cannot make us access beyond the file.
    pub fn map(fd: OwnedFd) -> io::Result<SharedMem> {
        let len = file_size(fd.as_fd())?;
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "empty shared memory",
            ));
        }
        Self::map_at(fd, 0, len)
    }

    /// Maps `len` bytes of `fd` from `off` (page aligned, inside the file),
    /// keeping the descriptor.
    fn map_at(fd: OwnedFd, off: u64, len: usize) -> io::Result<SharedMem> {
        let off = libc::off_t::try_from(off).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: mapping `len` bytes of a regular shared file at a
        // kernel-chosen address; the callers checked that the range lies in
        // the file (and the kernel refuses an unaligned offset).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedMem {
            ptr: NonNull::new(p.cast()).expect("mmap returned null"),
            len,
            fd: Some(fd),
        })
    }

    /// Maps memory a peer handed us and closes the descriptor. Refused unless
    /// it is a memfd whose size is sealed against shrinking (a peer that
    /// shrank it under our mapping would crash us with SIGBUS at our next
    /// access; anything else, e.g. a file on a FUSE mount, could block us in
    /// a page fault) and exactly `len` bytes long (a peer cannot make us
    /// reserve more address space than the protocol says).
    pub fn map_peer(fd: OwnedFd, len: usize) -> io::Result<SharedMem> {
        check_peer_seals(fd.as_fd())?;
        let size = file_size(fd.as_fd())?;
        if size != len || len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("peer memory is {size} bytes, expected {len}"),
            ));
        }
        let mut m = Self::map_at(fd, 0, len)?;
        m.fd = None;
        Ok(m)
    }

    /// Maps `len` bytes at `off` of memory a peer handed us (one region of a
    /// larger memfd) and closes the descriptor. Refused unless the memfd is
    /// sealed against shrinking (see [`SharedMem::map_peer`]), `off` is page
    /// aligned and the range lies inside it. Only the range is mapped, so a
    /// peer cannot make us reserve more address space than the protocol
    /// says, whatever the size of the file.
    pub fn map_peer_range(fd: OwnedFd, off: u64, len: usize) -> io::Result<SharedMem> {
        check_peer_seals(fd.as_fd())?;
        let size = file_size(fd.as_fd())? as u64;
        let end = off.checked_add(len as u64);
        if len == 0 || !off.is_multiple_of(page_size() as u64) || end.is_none_or(|e| e > size) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{len} bytes at {off} are not a page-aligned range of the peer's {size}"),
            ));
        }
        let mut m = Self::map_at(fd, off, len)?;
        m.fd = None;
        Ok(m)
    }

    /// Gives the pages of `len` bytes at `off` (page aligned) back to the
    /// system (`MADV_REMOVE`, a hole punched in the memfd): they read as
    /// zeros afterwards, in every process that maps them, and cost no
    /// memory until written again.
    pub fn discard(&self, off: usize, len: usize) -> io::Result<()> {
        self.check(off, len)?;
        let page = page_size();
        if !off.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "discarding an unaligned range",
            ));
        }
        if len == 0 {
            return Ok(());
        }
        // SAFETY: a page-aligned range inside our shared, writable mapping.
        // Its bytes become zeros under whoever accesses them, as when a peer
        // writes them: all access goes through raw copies and atomics.
        cvt(unsafe { libc::madvise(self.ptr.as_ptr().add(off).cast(), len, libc::MADV_REMOVE) })?;
        Ok(())
    }

    /// Mapping length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the mapping is empty (never true).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The memfd, unless it was closed.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }
    /// Closes the memfd; the mapping stays.
    pub fn close_fd(&mut self) {
        self.fd = None;
    }

    #[cold]
    fn out_of_bounds() -> io::Error {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "shared memory access out of bounds",
        )
    }

    #[cold]
    fn unaligned() -> io::Error {
        io::Error::new(io::ErrorKind::InvalidInput, "unaligned atomic")
    }

    // (inlined, its error out of line: every header word and slot access
    // of the shm device's data path comes through here)
    #[inline]
    fn check(&self, off: usize, len: usize) -> io::Result<()> {
        match off.checked_add(len) {
            Some(e) if e <= self.len => Ok(()),
            _ => Err(Self::out_of_bounds()),
        }
    }

    /// Copies `buf.len()` bytes out of the mapping at `off`.
    pub fn read(&self, off: usize, buf: &mut [u8]) -> io::Result<()> {
        self.check(off, buf.len())?;
        // SAFETY: bounds checked above; the source is mapped for the lifetime of
        // self and may be modified concurrently by a peer, which (as with real
        // RDMA) can only produce torn bytes, never invalid values for u8.
        unsafe {
            crate::copy::copy_nonoverlapping(
                self.ptr.as_ptr().add(off),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        Ok(())
    }

    /// Copies `data` into the mapping at `off`.
    pub fn write(&self, off: usize, data: &[u8]) -> io::Result<()> {
        self.check(off, data.len())?;
        // SAFETY: bounds checked above; destination is our writable shared mapping
        // which no Rust reference aliases (only raw copies and atomics are used).
        unsafe {
            crate::copy::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(off), data.len())
        };
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_off` to `self` at `dst_off`
    /// (both bounds checked; `crate::copy` says how).
    pub fn copy_from(
        &self,
        dst_off: usize,
        src: &SharedMem,
        src_off: usize,
        len: usize,
    ) -> io::Result<()> {
        self.check(dst_off, len)?;
        src.check(src_off, len)?;
        // SAFETY: both ranges are bounds checked inside live mappings. If src and
        // self map the same file the ranges may overlap, so use copy (memmove).
        unsafe {
            crate::copy::copy(
                src.ptr.as_ptr().add(src_off),
                self.ptr.as_ptr().add(dst_off),
                len,
            )
        };
        Ok(())
    }

    /// Reads from `fd` straight into the ranges `parts` (offset, length) of
    /// the mapping, in order, with one `readv` (`at`: `None`) or `preadv`
    /// (at file offset `at`): the kernel copies from the file, pipe or socket
    /// into this memory, no buffer of ours in between. Bytes read (fewer
    /// than asked at end of file or with a short read, as `readv`).
    pub fn read_fd(
        &self,
        parts: &[(usize, usize)],
        fd: BorrowedFd<'_>,
        at: Option<u64>,
    ) -> io::Result<usize> {
        self.vectored(parts, fd, at, false)
    }

    /// Writes the ranges `parts` of the mapping to `fd`, in order, with one
    /// `writev` (`at`: `None`) or `pwritev` (at file offset `at`): the kernel
    /// copies out of this memory. Bytes written (possibly fewer, as
    /// `writev`).
    pub fn write_fd(
        &self,
        parts: &[(usize, usize)],
        fd: BorrowedFd<'_>,
        at: Option<u64>,
    ) -> io::Result<usize> {
        self.vectored(parts, fd, at, true)
    }

    /// [`Self::read_fd`] (`to_fd` false) or [`Self::write_fd`].
    fn vectored(
        &self,
        parts: &[(usize, usize)],
        fd: BorrowedFd<'_>,
        at: Option<u64>,
        to_fd: bool,
    ) -> io::Result<usize> {
        let iov = self.iovecs(parts)?;
        let (fd, p, cnt) = (fd.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int);
        // SAFETY: every iovec lies inside this live mapping (checked by
        // `iovecs`). Reading into it, the kernel writes it as it would a user
        // buffer, and no Rust reference aliases the mapping (only raw copies
        // and atomics touch it); writing from it, the kernel only reads it,
        // and bytes a peer changes meanwhile go out as they are (torn at
        // worst), as with a real RDMA buffer.
        let r = unsafe {
            match (to_fd, at) {
                (false, None) => libc::readv(fd, p, cnt),
                (false, Some(off)) => libc::preadv(fd, p, cnt, off as libc::off_t),
                (true, None) => libc::writev(fd, p, cnt),
                (true, Some(off)) => libc::pwritev(fd, p, cnt, off as libc::off_t),
            }
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(r as usize)
    }

    /// `parts` as iovecs into the mapping, each bounds checked (at most
    /// `IOV_MAX` of them: a ring's window has two).
    fn iovecs(&self, parts: &[(usize, usize)]) -> io::Result<Vec<libc::iovec>> {
        if parts.len() > 1024 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "more than IOV_MAX ranges",
            ));
        }
        parts
            .iter()
            .map(|&(off, len)| {
                self.check(off, len)?;
                Ok(libc::iovec {
                    // SAFETY: `off` is inside the mapping (checked above).
                    iov_base: unsafe { self.ptr.as_ptr().add(off) }.cast(),
                    iov_len: len,
                })
            })
            .collect()
    }

    /// Fills a range with a byte.
    pub fn fill(&self, off: usize, len: usize, byte: u8) -> io::Result<()> {
        self.check(off, len)?;
        // SAFETY: bounds checked; writes plain bytes into our mapping.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(off), byte, len) };
        Ok(())
    }

    /// `N` consecutive atomic u64s from `off`, as [`Self::atomic`] gives
    /// each, with one bounds check for all of them (a region's registration
    /// words, read before every write into it).
    #[inline]
    pub fn atomics<const N: usize>(&self, off: usize) -> io::Result<[&AtomicU64; N]> {
        self.check(off, 8 * N)?;
        if !off.is_multiple_of(8) {
            return Err(Self::unaligned());
        }
        // SAFETY: as in `atomic`, for each of the N words, all within the
        // range checked above.
        Ok(std::array::from_fn(|i| unsafe {
            &*(self.ptr.as_ptr().add(off + 8 * i) as *const AtomicU64)
        }))
    }

    /// An atomic u64 at `off` (8-byte aligned, in bounds) shared with peers.
    #[inline]
    pub fn atomic(&self, off: usize) -> io::Result<&AtomicU64> {
        self.check(off, 8)?;
        if !off.is_multiple_of(8) {
            return Err(Self::unaligned());
        }
        // SAFETY: in bounds, 8-byte aligned (mapping is page aligned), lives as
        // long as &self; AtomicU64 has the same layout as u64 and all
        // cross-process access to these words is atomic.
        Ok(unsafe { &*(self.ptr.as_ptr().add(off) as *const AtomicU64) })
    }

    /// Sleeps while the 32-bit half of the u64 word at `off` that holds its
    /// low bits is `expected`, until a thread of any process that maps the
    /// same memory wakes it ([`Self::futex_wake`]), `timeout` passes or a
    /// signal arrives (a shared, not a process-private, futex: the kernel
    /// keys it by the memory's page, futex(2)). Returns at once if the word
    /// holds something else.
    pub fn futex_wait(
        &self,
        off: usize,
        expected: u32,
        timeout: Option<Duration>,
    ) -> io::Result<()> {
        let w = self.atomic(off)?;
        let half = futex_half(w);
        let ts = timeout.map(|d| libc::timespec {
            tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        });
        let tsp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `half` points to an aligned u32 inside our live mapping
        // (checked by `atomic`); the kernel only reads it; `tsp` is null or
        // points to a timespec on our stack for the duration of the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex,
                half,
                libc::FUTEX_WAIT,
                expected,
                tsp,
                std::ptr::null::<u32>(),
                0u32,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) | Some(libc::ETIMEDOUT) => Ok(()),
                _ => Err(e),
            };
        }
        Ok(())
    }

    /// Wakes the threads (of any process) sleeping in [`Self::futex_wait`]
    /// on the word at `off`.
    pub fn futex_wake(&self, off: usize) -> io::Result<()> {
        let w = self.atomic(off)?;
        let half = futex_half(w);
        // SAFETY: as in `futex_wait`; FUTEX_WAKE does not access the word.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex,
                half,
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// The address of the 32-bit half of `w` that holds its low bits (a futex
/// word is 32 bits; the shared words are u64 whose values here stay small).
fn futex_half(w: &AtomicU64) -> *const u32 {
    let p = w as *const AtomicU64 as *const u32;
    if cfg!(target_endian = "little") {
        p
    } else {
        p.wrapping_add(1)
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the region mapped in `map`; no references
        // into it outlive self (atomics borrow self).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The size of the file behind `fd`.
fn file_size(fd: BorrowedFd<'_>) -> io::Result<usize> {
    // SAFETY: fstat writes into a zeroed local stat struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and pointer to a local stat.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    usize::try_from(st.st_size).map_err(|_| io::ErrorKind::InvalidData.into())
}

/// Memory from a peer must be a memfd sealed against shrinking.
/// `read(2)` (`at`: `None`) or `pread(2)` at file offset `at` into `buf`.
pub fn read_into(fd: BorrowedFd<'_>, buf: &mut [u8], at: Option<u64>) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length.
    let r = unsafe {
        match at {
            None => libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()),
            Some(off) => libc::pread(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                off as libc::off_t,
            ),
        }
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// `write(2)` (`at`: `None`) or `pwrite(2)` at file offset `at` from `buf`.
pub fn write_from(fd: BorrowedFd<'_>, buf: &[u8], at: Option<u64>) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of its length.
    let r = unsafe {
        match at {
            None => libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()),
            Some(off) => libc::pwrite(
                fd.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                off as libc::off_t,
            ),
        }
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as usize)
}

fn check_peer_seals(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_GET_SEALS on a valid descriptor; fails with EINVAL for
    // anything but a memfd (shmem or hugetlbfs).
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "peer memory is not a memfd sealed against shrinking",
        ));
    }
    Ok(())
}

/// The system's page size.
pub fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no memory-safety preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(p).ok().filter(|p| *p > 0).unwrap_or(4096)
    })
}

/// A unix `SOCK_SEQPACKET` socket that can pass descriptors.
#[derive(Debug)]
pub struct SeqPacket {
    fd: OwnedFd,
}

fn sockaddr(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: sockaddr_un is plain data; zero is a valid value.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let b = path.as_os_str().as_bytes();
    if b.len() >= a.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    for (d, s) in a.sun_path.iter_mut().zip(b) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + b.len() + 1;
    Ok((a, len as libc::socklen_t))
}

fn new_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket has no memory preconditions.
    let fd =
        cvt(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl SeqPacket {
    /// Binds and listens at `path` (an existing file there is replaced).
    pub fn listen(path: &Path) -> io::Result<SeqPacket> {
        let _ = std::fs::remove_file(path);
        let fd = new_socket()?;
        let (a, len) = sockaddr(path)?;
        // SAFETY: a is a valid sockaddr_un of length len.
        cvt(unsafe { libc::bind(fd.as_raw_fd(), (&a as *const libc::sockaddr_un).cast(), len) })?;
        // SAFETY: listen on a bound socket.
        cvt(unsafe { libc::listen(fd.as_raw_fd(), 64) })?;
        Ok(SeqPacket { fd })
    }

    /// Connects to a listening socket.
    pub fn connect(path: &Path) -> io::Result<SeqPacket> {
        let fd = new_socket()?;
        let (a, len) = sockaddr(path)?;
        // SAFETY: a is a valid sockaddr_un of length len.
        cvt(unsafe {
            libc::connect(fd.as_raw_fd(), (&a as *const libc::sockaddr_un).cast(), len)
        })?;
        Ok(SeqPacket { fd })
    }

    /// Connects, waiting at most `t` for room in a full backlog (the send
    /// timeout, which also bounds later blocking sends, bounds a unix
    /// socket's connect).
    pub fn connect_timeout(path: &Path, t: Duration) -> io::Result<SeqPacket> {
        let s = SeqPacket { fd: new_socket()? };
        s.set_timeout(libc::SO_SNDTIMEO, t)?;
        let (a, len) = sockaddr(path)?;
        // SAFETY: a is a valid sockaddr_un of length len.
        cvt(unsafe {
            libc::connect(
                s.fd.as_raw_fd(),
                (&a as *const libc::sockaddr_un).cast(),
                len,
            )
        })?;
        Ok(s)
    }

    /// Makes the socket (a listener: its accepts) non-blocking.
    pub fn set_nonblocking(&self) -> io::Result<()> {
        set_nonblocking(self.fd.as_fd())
    }

    /// Is a listener alive at `path`? A non-blocking connect that is refused
    /// (`ECONNREFUSED`: the socket file of a dead process) or finds no socket
    /// (`ENOENT`) means no; a connection, or a full backlog (`EAGAIN`: alive
    /// but not accepting), means yes. The probe connection is closed at once.
    pub fn probe(path: &Path) -> bool {
        let Ok((a, len)) = sockaddr(path) else {
            return false;
        };
        // SAFETY: socket has no memory preconditions.
        let fd = unsafe {
            libc::socket(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                0,
            )
        };
        if fd < 0 {
            return true; // cannot tell: do not declare anything dead
        }
        // SAFETY: fresh descriptor we own (closed on drop).
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a is a valid sockaddr_un of length len.
        let r =
            unsafe { libc::connect(fd.as_raw_fd(), (&a as *const libc::sockaddr_un).cast(), len) };
        if r == 0 {
            return true;
        }
        !matches!(
            io::Error::last_os_error().raw_os_error(),
            Some(libc::ECONNREFUSED) | Some(libc::ENOENT) | Some(libc::ENOTSOCK)
        )
    }

    /// Accepts one connection (blocking unless the listener was polled readable).
    pub fn accept(&self) -> io::Result<SeqPacket> {
        self.accept_flags(libc::SOCK_CLOEXEC)
    }

    /// Accepts one connection as a non-blocking socket.
    pub fn accept_nonblocking(&self) -> io::Result<SeqPacket> {
        self.accept_flags(libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK)
    }

    fn accept_flags(&self, flags: libc::c_int) -> io::Result<SeqPacket> {
        // SAFETY: accept4 with null address pointers is allowed.
        let fd = cvt(unsafe {
            libc::accept4(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                flags,
            )
        })?;
        // SAFETY: fresh descriptor we own.
        Ok(SeqPacket {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    fn set_timeout(&self, opt: libc::c_int, t: Duration) -> io::Result<()> {
        let tv = libc::timeval {
            tv_sec: t.as_secs() as libc::time_t,
            tv_usec: t.subsec_micros() as libc::suseconds_t,
        };
        // SAFETY: passes a pointer to a local timeval of the right size.
        cvt(unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        })?;
        Ok(())
    }

    /// Sets the receive timeout.
    pub fn set_read_timeout(&self, t: Duration) -> io::Result<()> {
        self.set_timeout(libc::SO_RCVTIMEO, t)
    }

    /// Sets the send timeout.
    pub fn set_write_timeout(&self, t: Duration) -> io::Result<()> {
        self.set_timeout(libc::SO_SNDTIMEO, t)
    }

    /// Sends one message with up to 4 descriptors.
    pub fn send(&self, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        self.send_flags(data, fds, 0)
    }

    /// Sends one message without blocking (`WouldBlock` if the peer's queue
    /// is full: a peer that does not read cannot hold us up).
    pub fn try_send(&self, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        self.send_flags(data, fds, libc::MSG_DONTWAIT)
    }

    fn send_flags(
        &self,
        data: &[u8],
        fds: &[BorrowedFd<'_>],
        flags: libc::c_int,
    ) -> io::Result<()> {
        assert!(fds.len() <= 4);
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut _,
            iov_len: data.len(),
        };
        let mut cbuf = [0u64; 8]; // 64 bytes, aligned, enough for 4 fds
                                  // SAFETY: msghdr is plain data; zero is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            // SAFETY: CMSG_SPACE is a pure computation.
            let space = unsafe { libc::CMSG_SPACE((fds.len() * 4) as u32) } as usize;
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = space;
            // SAFETY: msg_control points to a 64-byte buffer >= space, so the
            // first header and its data (CMSG_LEN(4*n)) fit.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN((fds.len() * 4) as u32) as usize;
                let d = libc::CMSG_DATA(c) as *mut RawFd;
                for (i, f) in fds.iter().enumerate() {
                    d.add(i).write_unaligned(f.as_raw_fd());
                }
            }
        }
        // SAFETY: msg references live buffers (iov, cbuf) for the call.
        let r = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | flags) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Receives one message; returns its length (0 = peer closed) and
    /// descriptors. A message whose descriptors did not all arrive (this
    /// process has no free descriptor slot, or the sender attached more than
    /// fit) is an error; the ones that did arrive are closed.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
        self.recv_flags(buf, 0)
    }

    /// [`SeqPacket::recv`] without blocking (`WouldBlock` if nothing is queued).
    pub fn try_recv(&self, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
        self.recv_flags(buf, libc::MSG_DONTWAIT)
    }

    fn recv_flags(&self, buf: &mut [u8], flags: libc::c_int) -> io::Result<(usize, Vec<OwnedFd>)> {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut cbuf = [0u64; 8];
        // SAFETY: msghdr is plain data.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cbuf);
        // SAFETY: msg references live buffers for the call.
        let r = unsafe {
            libc::recvmsg(
                self.fd.as_raw_fd(),
                &mut msg,
                libc::MSG_CMSG_CLOEXEC | flags,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut out = Vec::new();
        // SAFETY: walking the control buffer the kernel filled, using the CMSG
        // macros that respect msg_controllen; each SCM_RIGHTS fd is new and ours.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let n = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / 4;
                    let d = libc::CMSG_DATA(c) as *const RawFd;
                    for i in 0..n {
                        out.push(OwnedFd::from_raw_fd(d.add(i).read_unaligned()));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::other(
                "descriptors of a message were dropped (no free descriptor slot, or too many sent)",
            ));
        }
        Ok((r as usize, out))
    }
}

/// Sets `O_NONBLOCK` on a descriptor (e.g. an eventfd a peer handed us: a
/// write to it must never block, whatever the peer made it).
pub fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a valid descriptor.
    let fl = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK) })?;
    Ok(())
}

/// Whether `fd` is an eventfd (the only kind of descriptor a peer may hand
/// us as a completion channel): asked of `/proc/self/fd`, which names an
/// eventfd `anon_inode:[eventfd]`.
pub fn is_eventfd(fd: BorrowedFd<'_>) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|l| l.as_os_str() == "anon_inode:[eventfd]")
}

/// Fills `buf` from the kernel's random source (`getrandom`, else
/// `/dev/urandom`).
pub fn random_bytes(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: writes at most buf.len() - done bytes into buf[done..].
        let r = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            use std::io::Read;
            return std::fs::File::open("/dev/urandom")?.read_exact(&mut buf[done..]);
        }
        done += r as usize;
    }
    Ok(())
}

/// The process's descriptor limit (`RLIMIT_NOFILE`): (soft, hard).
pub fn open_files_limit() -> io::Result<(u64, u64)> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into a local rlimit.
    cvt(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) })?;
    Ok((r.rlim_cur, r.rlim_max))
}

/// Sets the soft descriptor limit (tests that run a process out of descriptors).
pub fn set_open_files_limit(soft: u64) -> io::Result<()> {
    let (_, hard) = open_files_limit()?;
    let r = libc::rlimit {
        rlim_cur: soft.min(hard) as libc::rlim_t,
        rlim_max: hard as libc::rlim_t,
    };
    // SAFETY: setrlimit reads a local rlimit.
    cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) })?;
    Ok(())
}

impl AsFd for SeqPacket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// IP addresses configured on interface `ifname` (in the caller's netns).
pub fn if_addrs(ifname: &str) -> io::Result<Vec<std::net::IpAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list pointer into head.
    cvt(unsafe { libc::getifaddrs(&mut head) })?;
    let mut out = Vec::new();
    let mut cur = head;
    // SAFETY: walking the linked list returned by getifaddrs until null; each
    // node's name is a C string and addr (if non-null) a sockaddr of its family.
    unsafe {
        while !cur.is_null() {
            let ifa = &*cur;
            let name = std::ffi::CStr::from_ptr(ifa.ifa_name).to_string_lossy();
            if name == ifname && !ifa.ifa_addr.is_null() {
                match (*ifa.ifa_addr).sa_family as libc::c_int {
                    libc::AF_INET => {
                        let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                        out.push(std::net::IpAddr::V4(u32::from_be(a.sin_addr.s_addr).into()));
                    }
                    libc::AF_INET6 => {
                        let a = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                        out.push(std::net::IpAddr::V6(a.sin6_addr.s6_addr.into()));
                    }
                    _ => {}
                }
            }
            cur = ifa.ifa_next;
        }
        libc::freeifaddrs(head);
    }
    Ok(out)
}

/// Link-level facts of one network interface, as its own network namespace
/// sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    /// Administratively up and operationally up (or unknown), as
    /// `/sys/class/net/<if>/operstate` reports `up` (or `unknown` with IFF_UP).
    pub up: bool,
    /// The Ethernet-style hardware address, for interfaces that have one
    /// (Ethernet, veth, and `lo` with its all-zero address).
    pub mac: Option<[u8; 6]>,
    /// The MTU.
    pub mtu: u32,
}

/// The interface `ifname` of the caller's network namespace, or `None` if
/// that namespace has no such interface.
///
/// Asked through socket ioctls, which answer for the namespace the socket was
/// made in, never through `/sys/class/net`: that shows the interfaces of the
/// namespace that mounted sysfs, which is not ours after a plain
/// `setns(CLONE_NEWNET)` (as `nsenter --net` does). Takes a descriptor for the
/// moment of the call; [`LinkProbe`] keeps one instead.
pub fn link(ifname: &str) -> io::Result<Option<Link>> {
    LinkProbe::new()?.link(ifname)
}

/// A socket kept for [`link`]'s ioctls, so that a periodic look at an
/// interface needs no new descriptor (a process out of descriptors must not
/// take its interface for down).
#[derive(Debug)]
pub struct LinkProbe {
    sock: OwnedFd,
}

impl LinkProbe {
    /// A probe for the caller's network namespace.
    pub fn new() -> io::Result<LinkProbe> {
        // SAFETY: socket has no memory-safety preconditions.
        let fd =
            cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
        // SAFETY: fd was just returned by socket and is owned by nobody else.
        Ok(LinkProbe {
            sock: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// [`link`], through this probe's socket.
    pub fn link(&self, ifname: &str) -> io::Result<Option<Link>> {
        let mut name = [0 as libc::c_char; libc::IFNAMSIZ];
        if ifname.is_empty() || ifname.len() >= name.len() || ifname.bytes().any(|b| b == 0) {
            // not a name the kernel could have given an interface
            return Ok(None);
        }
        for (d, s) in name.iter_mut().zip(ifname.bytes()) {
            *d = s as libc::c_char;
        }
        let sock = &self.sock;
        let ask = |req: libc::c_ulong| -> io::Result<Option<libc::ifreq>> {
            // SAFETY: ifreq is plain old data (a name and a union of integers and
            // sockaddrs), for which all-zero bytes are a valid value.
            let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
            ifr.ifr_name = name;
            // SAFETY: the SIOCGIF* requests passed here read the NUL-terminated
            // name and write at most one ifreq into the local `ifr`.
            let r =
                unsafe { libc::ioctl(sock.as_raw_fd(), req as _, &mut ifr as *mut libc::ifreq) };
            match cvt(r) {
                Ok(_) => Ok(Some(ifr)),
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
                Err(e) => Err(e),
            }
        };
        let Some(f) = ask(libc::SIOCGIFFLAGS)? else {
            return Ok(None);
        };
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        let flags = i32::from(unsafe { f.ifr_ifru.ifru_flags }) & 0xffff;
        let Some(h) = ask(libc::SIOCGIFHWADDR)? else {
            return Ok(None);
        };
        // SAFETY: SIOCGIFHWADDR filled the hwaddr member of the union.
        let hw = unsafe { h.ifr_ifru.ifru_hwaddr };
        let mac = matches!(hw.sa_family, libc::ARPHRD_ETHER | libc::ARPHRD_LOOPBACK).then(|| {
            let mut m = [0u8; 6];
            for (d, s) in m.iter_mut().zip(hw.sa_data.iter()) {
                *d = *s as u8;
            }
            m
        });
        let Some(m) = ask(libc::SIOCGIFMTU)? else {
            return Ok(None);
        };
        // SAFETY: SIOCGIFMTU filled the mtu member of the union.
        let mtu = unsafe { m.ifr_ifru.ifru_mtu }.max(0) as u32;
        // The kernel reports IFF_RUNNING exactly when the interface is open and its
        // operational state is up or unknown.
        let up = flags & (libc::IFF_UP | libc::IFF_RUNNING) == libc::IFF_UP | libc::IFF_RUNNING;
        Ok(Some(Link { up, mac, mtu }))
    }
}

/// A route netlink socket subscribed to the kernel's link and address
/// notifications (RTMGRP_LINK: an interface's flags or operational state
/// changed, RTM_NEWLINK/RTM_DELLINK; RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR:
/// an address came or went) of the caller's network namespace: readable as
/// soon as something changed, so a device thread learns of a port going
/// down when the kernel does instead of at its next look. What changed is
/// read again through [`LinkProbe`] (the messages only wake the reader): a
/// notification lost to a full socket buffer (ENOBUFS) wakes it all the same.
#[derive(Debug)]
pub struct LinkWatch {
    sock: OwnedFd,
}

impl LinkWatch {
    /// A watch of the caller's network namespace (non-blocking).
    pub fn new() -> io::Result<LinkWatch> {
        // SAFETY: socket has no memory-safety preconditions.
        let fd = cvt(unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                libc::NETLINK_ROUTE,
            )
        })?;
        // SAFETY: fd was just returned by socket and is owned by nobody else.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl is plain old data; all-zero is a valid value.
        let mut a: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        a.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        a.nl_groups =
            (libc::RTMGRP_LINK | libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR) as u32;
        // SAFETY: `a` is a valid sockaddr_nl of the length passed; bind reads it only.
        cvt(unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&a as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        })?;
        Ok(LinkWatch { sock })
    }

    /// Reads every queued notification; whether there was any (or an
    /// overrun, which lost some).
    pub fn drain(&self) -> bool {
        let mut any = false;
        let mut buf = [0u8; 8192];
        loop {
            // SAFETY: recv writes at most buf.len() bytes into the local buffer.
            let r = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if r > 0 {
                any = true;
                continue;
            }
            if r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOBUFS) {
                any = true;
                continue;
            }
            return any;
        }
    }
}

impl AsFd for LinkWatch {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

/// One address of an interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceAddr {
    /// Interface name.
    pub ifname: String,
    /// The address.
    pub addr: std::net::IpAddr,
    /// Prefix length (bits set in the netmask).
    pub prefix_len: u8,
}

/// Every IP address of every interface (in the caller's netns), with prefix
/// lengths: what the SMC socket library needs to find a connection's interface
/// and the prefixes CLC compares.
pub fn interface_addrs() -> io::Result<Vec<InterfaceAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list pointer into head.
    cvt(unsafe { libc::getifaddrs(&mut head) })?;
    let mut out = Vec::new();
    let mut cur = head;
    // SAFETY: walking the list getifaddrs returned until null; each node's name is
    // a C string, and addr/netmask (if non-null) are sockaddrs of the node's
    // family, so the casts below read only what the kernel wrote. The list is
    // freed once at the end and not used afterwards.
    unsafe {
        while !cur.is_null() {
            let ifa = &*cur;
            if !ifa.ifa_addr.is_null() {
                let name = std::ffi::CStr::from_ptr(ifa.ifa_name)
                    .to_string_lossy()
                    .into_owned();
                let mask = ifa.ifa_netmask;
                match (*ifa.ifa_addr).sa_family as libc::c_int {
                    libc::AF_INET => {
                        let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                        let bits = if mask.is_null() {
                            32
                        } else {
                            let m = &*(mask as *const libc::sockaddr_in);
                            u32::from_be(m.sin_addr.s_addr).count_ones() as u8
                        };
                        out.push(InterfaceAddr {
                            ifname: name,
                            addr: std::net::IpAddr::V4(u32::from_be(a.sin_addr.s_addr).into()),
                            prefix_len: bits,
                        });
                    }
                    libc::AF_INET6 => {
                        let a = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                        let bits = if mask.is_null() {
                            128
                        } else {
                            let m = &*(mask as *const libc::sockaddr_in6);
                            m.sin6_addr
                                .s6_addr
                                .iter()
                                .map(|b| b.count_ones() as u8)
                                .sum()
                        };
                        out.push(InterfaceAddr {
                            ifname: name,
                            addr: std::net::IpAddr::V6(a.sin6_addr.s6_addr.into()),
                            prefix_len: bits,
                        });
                    }
                    _ => {}
                }
            }
            cur = ifa.ifa_next;
        }
        libc::freeifaddrs(head);
    }
    Ok(out)
}

/// Signals a process (used by tests to kill or freeze a peer).
#[derive(Clone, Copy, Debug)]
pub enum Signal {
    /// SIGKILL.
    Kill,
    /// SIGSTOP.
    Stop,
    /// SIGCONT.
    Cont,
}

/// Sends `sig` to process `pid`.
pub fn send_signal(pid: u32, sig: Signal) -> io::Result<()> {
    let s = match sig {
        Signal::Kill => libc::SIGKILL,
        Signal::Stop => libc::SIGSTOP,
        Signal::Cont => libc::SIGCONT,
    };
    // SAFETY: kill has no memory-safety preconditions.
    cvt(unsafe { libc::kill(pid as libc::pid_t, s) })?;
    Ok(())
}

/// The calling thread's id (`gettid(2)`), the name /proc gives it in this
/// process's pid namespace.
pub fn thread_id() -> u32 {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() as u32 }
}

/// The inode of this process's pid namespace (`/proc/self/ns/pid`), 0 when
/// it cannot be read: two processes name each other's threads alike only
/// when theirs are the same.
pub fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// The scheduler state of thread `tid` of this pid namespace, the letter
/// of the third field of `/proc/TID/stat` (proc(5): `R` running or
/// runnable, `S` sleeping, `D` waiting in the kernel, `T` stopped, ...), or
/// `None` if there is no such thread or the file cannot be read.
pub fn thread_state(tid: u32) -> Option<u8> {
    if tid == 0 {
        return None;
    }
    let stat = std::fs::read(format!("/proc/{tid}/stat")).ok()?;
    // The command name (second field) is in parentheses and may hold any
    // byte, ")" too: the state follows the last ")".
    let close = stat.iter().rposition(|&b| b == b')')?;
    stat.get(close + 2).copied()
}

/// Whether the process runs as root (tests needing netns/veth check this).
pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer holding a copy of our eventfd (a doorbell's, a completion
    /// channel's) clears `O_NONBLOCK` on the description we share: a drain
    /// of a counter at 0 still returns at once, and one of a signalled
    /// counter still takes it.
    #[test]
    fn a_drain_never_blocks_though_a_peer_made_the_eventfd_blocking() {
        let e = EventFd::new().unwrap();
        let peer = e.as_fd().try_clone_to_owned().unwrap();
        // SAFETY: F_SETFL on a descriptor of ours, as the peer would.
        assert_eq!(
            unsafe { libc::fcntl(peer.as_raw_fd(), libc::F_SETFL, 0) },
            0
        );
        // SAFETY: F_GETFL on our own descriptor.
        let flags = unsafe { libc::fcntl(e.as_fd().as_raw_fd(), libc::F_GETFL) };
        assert_eq!(flags & libc::O_NONBLOCK, 0, "the flag is the description's");
        let (tx, rx) = std::sync::mpsc::channel();
        let e = std::sync::Arc::new(e);
        let e2 = e.clone();
        std::thread::spawn(move || {
            let _ = tx.send(e2.drain());
        });
        // (a hang detector, not a latency bound)
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)),
            Ok(false),
            "a drain of nothing returns at once"
        );
        signal_fd(peer.as_fd());
        assert!(e.drain(), "a signal is taken");
        assert!(!e.drain(), "and only once");
    }

    #[test]
    fn a_running_thread_reads_as_runnable_and_a_missing_one_as_unknown() {
        assert_eq!(thread_state(thread_id()), Some(b'R'));
        assert_eq!(thread_state(0), None);
        assert_ne!(pid_namespace(), 0);
    }

    #[test]
    fn shared_mem_bounds_and_sharing() {
        let a = SharedMem::create("t", 8192).unwrap();
        assert_eq!(a.len(), 8192);
        a.write(100, b"hello").unwrap();
        assert!(a.write(8190, b"abc").is_err());
        assert!(a.read(usize::MAX, &mut [0u8; 2]).is_err());
        assert!(a.atomic(4).is_err());
        assert!(a.atomic(8192).is_err());
        // A second mapping of the same memfd sees the same bytes.
        let b = SharedMem::map(a.fd().unwrap().try_clone_to_owned().unwrap()).unwrap();
        let mut buf = [0u8; 5];
        b.read(100, &mut buf).unwrap();
        assert_eq!(&buf, b"hello");
        b.copy_from(0, &a, 100, 5).unwrap();
        a.read(0, &mut buf).unwrap();
        assert_eq!(&buf, b"hello");
        assert!(b.copy_from(8190, &a, 0, 5).is_err());
        assert!(SharedMem::create("z", 0).is_err());
    }

    #[test]
    fn peer_memory_must_be_a_sealed_memfd_of_the_announced_size() {
        let a = SharedMem::create("t", 8192).unwrap();
        let dup = || a.fd().unwrap().try_clone_to_owned().unwrap();
        // Whoever holds a copy of the descriptor cannot shrink it under our mapping.
        // SAFETY: ftruncate on a valid descriptor.
        let r = unsafe { libc::ftruncate(dup().as_raw_fd(), 4096) };
        assert!(r < 0, "a sealed memfd was shrunk");
        assert!(
            SharedMem::map_peer(dup(), 4096).is_err(),
            "wrong size taken"
        );
        let m = SharedMem::map_peer(dup(), 8192).unwrap();
        assert!(m.fd().is_none(), "the peer's descriptor is kept");
        // A plain file (no seals possible) is refused.
        let path = std::env::temp_dir().join(format!("smc-sys-file-{}", std::process::id()));
        std::fs::write(&path, [0u8; 8192]).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        assert!(SharedMem::map_peer(f.into(), 8192).is_err());
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn peer_ranges_are_page_aligned_and_inside_a_sealed_memfd() {
        let page = page_size();
        let a = SharedMem::create("t", 4 * page).unwrap();
        let dup = || a.fd().unwrap().try_clone_to_owned().unwrap();
        a.write(2 * page + 5, b"range").unwrap();
        let m = SharedMem::map_peer_range(dup(), 2 * page as u64, page + 100).unwrap();
        assert!(m.fd().is_none(), "the peer's descriptor is kept");
        assert_eq!(m.len(), page + 100, "only the range is mapped");
        let mut b = [0u8; 5];
        m.read(5, &mut b).unwrap();
        assert_eq!(&b, b"range");
        assert!(m.read(page + 100, &mut [0u8; 1]).is_err());
        for (off, len) in [
            (3 * page as u64, page + 1), // past the end
            (100, page),                 // unaligned
            (!(page as u64 - 1), page),  // overflows
            (0, 0),
        ] {
            let r = SharedMem::map_peer_range(dup(), off, len);
            assert_eq!(
                r.map(|_| ()).unwrap_err().kind(),
                io::ErrorKind::InvalidData,
                "{off} {len}"
            );
        }
        let path = std::env::temp_dir().join(format!("smc-sys-range-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 4 * page]).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        assert!(SharedMem::map_peer_range(f.into(), 0, page).is_err());
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn discarded_pages_read_as_zeros_everywhere() {
        let page = page_size();
        let a = SharedMem::create("t", 4 * page).unwrap();
        let b = SharedMem::map_peer_range(
            a.fd().unwrap().try_clone_to_owned().unwrap(),
            page as u64,
            2 * page,
        )
        .unwrap();
        a.fill(0, 4 * page, 0x5a).unwrap();
        a.discard(page, page).unwrap();
        let mut x = [0u8; 2];
        a.read(page - 1, &mut x).unwrap();
        assert_eq!(x, [0x5a, 0], "only the range goes");
        b.read(page - 1, &mut x).unwrap();
        assert_eq!(x, [0, 0x5a], "the peer's mapping sees the hole");
        assert!(a.discard(1, page).is_err(), "unaligned");
        assert!(a.discard(3 * page, 2 * page).is_err(), "out of bounds");
    }

    #[test]
    fn seqpacket_passes_descriptors() {
        let dir = std::env::temp_dir().join(format!("smc-sys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let l = SeqPacket::listen(&path).unwrap();
        let c = SeqPacket::connect(&path).unwrap();
        let s = l.accept().unwrap();
        let m = SharedMem::create("p", 4096).unwrap();
        m.write(0, b"shared").unwrap();
        let e = EventFd::new().unwrap();
        c.send(b"msg", &[m.fd().unwrap(), e.as_fd()]).unwrap();
        let mut buf = [0u8; 16];
        let (n, fds) = s.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"msg");
        assert_eq!(fds.len(), 2);
        let mut it = fds.into_iter();
        let m2 = SharedMem::map(it.next().unwrap()).unwrap();
        let mut b = [0u8; 6];
        m2.read(0, &mut b).unwrap();
        assert_eq!(&b, b"shared");
        let e2 = EventFd::from_owned(it.next().unwrap());
        e2.signal();
        assert!(e.wait(Duration::from_secs(1)).unwrap());
        assert!(!e.drain());
        drop(c);
        let (n, _) = s.recv(&mut buf).unwrap();
        assert_eq!(n, 0, "peer close reads as 0");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn eventfd_wait_times_out() {
        let e = EventFd::new().unwrap();
        let t = std::time::Instant::now();
        assert!(!e.wait(Duration::from_millis(20)).unwrap());
        assert!(t.elapsed() >= Duration::from_millis(15));
    }
}

#[cfg(test)]
mod interface_addr_tests {
    #[test]
    fn loopback_has_its_addresses_and_prefixes() {
        let v = super::interface_addrs().unwrap();
        let lo4 = v
            .iter()
            .find(|a| a.addr == std::net::IpAddr::from([127, 0, 0, 1]))
            .expect("127.0.0.1 on some interface");
        assert_eq!(lo4.ifname, "lo");
        assert_eq!(lo4.prefix_len, 8);
    }

    #[test]
    fn loopback_link_is_up_with_a_zero_mac() {
        let lo = super::link("lo").unwrap().expect("lo exists");
        assert!(lo.up);
        assert_eq!(lo.mac, Some([0; 6]));
        assert!(lo.mtu >= 1280, "{lo:?}");
    }

    #[test]
    fn missing_or_impossible_interfaces_are_none() {
        for bad in ["no-such-if0", "", "a\0b", "much-too-long-interface-name"] {
            assert_eq!(super::link(bad).unwrap(), None, "{bad:?}");
        }
    }
}

/// `fd` moved to a number in the upper half of the descriptor limit (at
/// most 4096 up: a higher number grows the process's descriptor table), if
/// there is room. For descriptors made per connection (this provider's
/// doorbell eventfds, the socket library's readiness descriptors): event
/// loops (wrk's, redis') size their tables by the descriptors they open
/// themselves and refuse a socket numbered above that, and a library that
/// takes low numbers for each connection pushes the application's own up.
pub fn out_of_the_way(fd: OwnedFd) -> OwnedFd {
    dup_high(fd.as_fd()).unwrap_or(fd)
}

/// A duplicate of `fd` numbered as [`out_of_the_way`] numbers one (where
/// there is no room, anywhere): one system call fewer than a duplicate
/// moved there, and no descriptor made only to be closed.
pub fn dup_out_of_the_way(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    match dup_high(fd) {
        Some(d) => Ok(d),
        None => fd.try_clone_to_owned(),
    }
}

/// `fd` duplicated (close-on-exec) into the upper half of the descriptor
/// limit, if there is room.
fn dup_high(fd: BorrowedFd<'_>) -> Option<OwnedFd> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    let cur = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        1024
    };
    let base = (cur / 2).clamp(64, 4096) as libc::c_int;
    // SAFETY: F_DUPFD_CLOEXEC on a descriptor the caller holds open; the
    // result, if any, is a new descriptor nobody else owns.
    let high = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, base) };
    if high < 0 {
        return None;
    }
    // SAFETY: just returned by fcntl, owned by nobody else.
    Some(unsafe { OwnedFd::from_raw_fd(high) })
}
