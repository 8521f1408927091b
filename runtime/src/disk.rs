//! The disk tier's file: one preallocated file in a directory the user gives (`--disk-dir`),
//! holding a schedule's disk region ([`protrain_ir::Space::Disk`]) at fixed offsets.
//!
//! [`DiskFile::create`] checks the file system's free space (`statvfs`), then makes a new
//! file there and allocates all of it (`posix_fallocate`: blocks reserved, reading as zeros,
//! nothing written), so that a disk too small fails at the start, naming the directory and
//! the figures, not in the middle of a step nor after filling the disk; the
//! file is removed when the [`DiskFile`] is dropped. A run killed with `kill -9` cannot remove
//! its file: every live file is held under an exclusive lock ([`File::try_lock`]) for the
//! life of its process, so the next [`DiskFile::create`] in the directory removes the files
//! nobody holds ([`sweep`]) and says which. Reads and writes are positioned
//! (`pread`/`pwrite` through [`FileExt`]), so several threads can use the file at once; the
//! schedule's events keep them off each other's bytes.
//!
//! For a file larger than the page cache could hold (over half the memory available), the bulk
//! of every transfer bypasses the page cache (`O_DIRECT`): the whole 4 KiB blocks of
//! a range that starts on a block boundary (every chunk's state does, see the compiler's
//! `DISK_ALIGN`) move straight between the disk and memory, through an aligned bounce buffer
//! when the memory side is not block-aligned; a range's unaligned head or tail goes through
//! the page cache. Measured on this project's 2-core test machine (sequential 8 MiB blocks of
//! a 1 to 2 GiB file, each write run ended by `fdatasync`; `benches/disk_tier.py` measures it
//! so): buffered writes reach 0.3 to 0.5 GB/s and `O_DIRECT` writes 1.5 to 2.4 GB/s, with
//! reads about equal (1.0 to 1.4 GB/s, the page cache dropped first). A state that lives on disk is larger than
//! host memory, so the page cache cannot hold it, and buffered writes end up at the rate of
//! the kernel's write-back; `O_DIRECT` also spares the copy into the cache. A file the page
//! cache can hold is better served from it (the same benchmark's tiny state moved 5.3 GB/s
//! buffered against 0.6 GB/s direct), so it stays buffered ([`DiskIo::from_env`]; set
//! `PROTRAIN_DISK_IO` to `direct` or `buffered` to choose). Where the file system refuses
//! `O_DIRECT` (tmpfs, some network file systems), everything goes through the page cache.
//!
//! A transfer is split into requests of at most [`BLOCK`] bytes ([`requests`], a plan computed
//! as data and tested on its own), and a small pool of threads owned by the file keeps up to
//! [`Queue::depth`] of them in flight at once (`pread`/`pwrite` on each), so that an NVMe
//! drive sees a queue deeper than one; `PROTRAIN_DISK_QUEUE` sets the depth ([`QUEUE_ENV`],
//! default [`DEPTH`]; 1 issues the requests one after another on the calling thread). The
//! bytes on disk and the file's format are the same at every depth. A failed transfer names
//! the file and the offset of the lowest request that failed.

use crate::error::{DiskIoCause, DiskProblem, Result, RuntimeError};
use std::alloc::Layout;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The block `O_DIRECT` transfers align to: file offsets, lengths and memory addresses.
pub const DIRECT_ALIGN: usize = 4096;

/// Most bytes of one request ([`requests`]); a request whose memory is not aligned moves
/// through a bounce buffer of this size.
pub const BLOCK: usize = 8 << 20;

/// Requests a transfer keeps in flight by default ([`Queue::from_env`]).
pub const DEPTH: usize = 4;

/// Most requests in flight [`QUEUE_ENV`] may ask for.
pub const MAX_DEPTH: usize = 64;

/// The environment variable that sets how many requests a transfer keeps in flight.
pub const QUEUE_ENV: &str = "PROTRAIN_DISK_QUEUE";

/// The environment variable that chooses the I/O (`direct`, `buffered`, or `auto`).
pub const IO_ENV: &str = "PROTRAIN_DISK_IO";

/// How a [`DiskFile`] moves the bulk of its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskIo {
    /// `O_DIRECT` for whole aligned blocks, the page cache for the rest.
    Direct,
    /// Everything through the page cache.
    Buffered,
}

impl DiskIo {
    /// The I/O for a file of `bytes`: what the environment asks for ([`IO_ENV`]: `direct`,
    /// `buffered`, or `auto`, the default), where `auto` is [`DiskIo::Direct`] when the page
    /// cache could not hold the file (it is over half the memory available now, or that is
    /// unknown) and [`DiskIo::Buffered`] when it could, since then reads come from memory.
    /// Fails, naming the variable, on any other value.
    pub fn from_env(bytes: u64) -> Result<Self> {
        let available = crate::memory::memory_available();
        Ok(Self::parse(std::env::var(IO_ENV).ok().as_deref())?
            .unwrap_or_else(|| Self::auto(bytes, available)))
    }

    /// [`DiskIo::from_env`]'s `auto` rule for `available` bytes of memory.
    fn auto(bytes: u64, available: Option<u64>) -> Self {
        match available {
            Some(available) if bytes <= available / 2 => DiskIo::Buffered,
            _ => DiskIo::Direct,
        }
    }

    /// The mode a value of [`IO_ENV`] names (`None`: unset, or `auto`).
    fn parse(value: Option<&str>) -> Result<Option<Self>> {
        match value {
            None | Some("") | Some("auto") => Ok(None),
            Some("direct") => Ok(Some(DiskIo::Direct)),
            Some("buffered") => Ok(Some(DiskIo::Buffered)),
            Some(other) => Err(RuntimeError::Disk {
                path: PathBuf::from(IO_ENV),
                problem: DiskProblem::BadIoMode {
                    var: IO_ENV,
                    value: other.to_string(),
                },
            }),
        }
    }
}

/// How a [`DiskFile`] splits its transfers into requests and how many it keeps in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Queue {
    /// Requests in flight at once (at least 1: one after another on the calling thread).
    pub depth: usize,
    /// Most bytes of one request, a multiple of [`DIRECT_ALIGN`].
    pub block: usize,
}

impl Queue {
    /// One request at a time, each of at most [`BLOCK`] bytes.
    pub const SERIAL: Queue = Queue {
        depth: 1,
        block: BLOCK,
    };

    /// The queue the environment asks for: [`QUEUE_ENV`] requests in flight (default
    /// [`DEPTH`]) of at most [`BLOCK`] bytes. Fails, naming the variable, on anything but a
    /// whole number from 1 to [`MAX_DEPTH`].
    pub fn from_env() -> Result<Self> {
        Self::parse(std::env::var(QUEUE_ENV).ok().as_deref())
    }

    fn parse(value: Option<&str>) -> Result<Self> {
        let depth = match value.map(str::trim) {
            None | Some("") => DEPTH,
            Some(text) => match text.parse::<usize>() {
                Ok(n) if (1..=MAX_DEPTH).contains(&n) => n,
                _ => {
                    return Err(RuntimeError::Disk {
                        path: PathBuf::from(QUEUE_ENV),
                        problem: DiskProblem::BadQueueDepth {
                            var: QUEUE_ENV,
                            value: text.to_string(),
                            most: MAX_DEPTH,
                        },
                    })
                }
            },
        };
        Ok(Queue {
            depth,
            block: BLOCK,
        })
    }
}

/// One request of a transfer ([`requests`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Where it starts, in bytes from the start of the transfer (in the file and in memory).
    pub at: usize,
    /// Its bytes.
    pub len: usize,
    /// Whether it bypasses the page cache (`O_DIRECT`): its file offset and length are
    /// multiples of [`DIRECT_ALIGN`].
    pub direct: bool,
}

/// The requests a transfer of `len` bytes at file offset `offset` is split into, in order,
/// covering it exactly: with `direct` and a block-aligned offset, the whole
/// [`DIRECT_ALIGN`] blocks of the range go with `O_DIRECT` in requests of at most `block`
/// bytes (a multiple of [`DIRECT_ALIGN`]), and the unaligned tail through the page cache;
/// otherwise all of it goes through the page cache, in requests of at most `block` bytes.
/// Each request starts a whole number of `block`s into the transfer, except the tail.
pub fn requests(offset: u64, len: usize, direct: bool, block: usize) -> Vec<Request> {
    assert!(
        block > 0 && block.is_multiple_of(DIRECT_ALIGN),
        "a request's size is a whole number of O_DIRECT blocks"
    );
    let whole = match direct && aligned(offset) {
        true => len / DIRECT_ALIGN * DIRECT_ALIGN,
        false => 0,
    };
    let split = |from: usize, to: usize, direct: bool| {
        (from..to).step_by(block).map(move |at| Request {
            at,
            len: block.min(to - at),
            direct,
        })
    };
    split(0, whole, true)
        .chain(split(whole, len, false))
        .collect()
}

/// A preallocated file holding a disk region; removed on drop.
#[derive(Debug)]
pub struct DiskFile {
    file: File,
    /// The same file opened with `O_DIRECT`, where the file system allows it.
    direct: Option<File>,
    /// Cleared when the file system turned an `O_DIRECT` transfer down after all (`EINVAL`):
    /// from then on everything goes through `file`.
    direct_ok: AtomicBool,
    path: PathBuf,
    bytes: u64,
    swept: Vec<PathBuf>,
    queue: Queue,
    /// The threads that keep [`Queue::depth`] requests in flight (none at depth 1).
    pool: Option<rayon::ThreadPool>,
    /// Bounce buffers of [`Queue::block`] bytes, for requests whose memory is not aligned;
    /// one per request in flight at most, made on first use.
    bounces: std::sync::Mutex<Vec<Aligned>>,
}

/// A zeroed allocation aligned to [`DIRECT_ALIGN`], for `O_DIRECT` transfers.
struct Aligned {
    ptr: NonNull<u8>,
    len: usize,
}

impl Aligned {
    fn zeroed(len: usize) -> Self {
        let len = len.max(1).next_multiple_of(DIRECT_ALIGN);
        let layout = Self::layout(len);
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, DIRECT_ALIGN).expect("a bounce buffer's size is small")
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes allocated (and zeroed) in `zeroed`, owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

// SAFETY: an `Aligned` owns its allocation alone, like a `Vec<u8>`.
unsafe impl Send for Aligned {}

impl std::fmt::Debug for Aligned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Aligned({} bytes)", self.len)
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

/// Whether `n` is a multiple of [`DIRECT_ALIGN`].
fn aligned(n: u64) -> bool {
    n.is_multiple_of(DIRECT_ALIGN as u64)
}

/// Files made by this process so far, for unique names.
static MADE: AtomicU64 = AtomicU64::new(0);

impl DiskFile {
    /// A new file of `bytes` zeros in `dir`, doing I/O as the environment says, or as suits
    /// its size ([`DiskIo::from_env`]), with the queue the environment asks for
    /// ([`Queue::from_env`]). Fails, naming the directory and the way out, when it does not
    /// exist, is not a directory, cannot be written, or has no room.
    pub fn create(dir: &Path, bytes: u64) -> Result<Self> {
        Self::create_for_rank(dir, bytes, None)
    }

    /// [`DiskFile::create`] for rank `rank` of a data-parallel run (each rank keeps its own
    /// shards in its own file): the file's name says the rank
    /// (`protrain-PID-N-rankR.state`), and [`sweep`] removes it after a killed run as any
    /// other. `None` names it as [`DiskFile::create`] does.
    pub fn create_for_rank(dir: &Path, bytes: u64, rank: Option<u32>) -> Result<Self> {
        let queue = Queue::from_env()?;
        Self::make(dir, bytes, DiskIo::from_env(bytes)?, rank)?.with_queue(queue)
    }

    /// The file with its transfers split and issued as `queue` says; fails when the threads
    /// cannot be started.
    pub fn with_queue(mut self, queue: Queue) -> Result<Self> {
        assert!(
            queue.depth > 0 && queue.block > 0 && queue.block.is_multiple_of(DIRECT_ALIGN),
            "a queue of at least one request of whole O_DIRECT blocks"
        );
        self.pool = match queue.depth {
            1 => None,
            depth => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(depth)
                    .thread_name(|i| format!("protrain-disk-{i}"))
                    .build()
                    .map_err(|e| RuntimeError::Disk {
                        path: self.path.clone(),
                        problem: DiskProblem::CannotCreate {
                            file: self.path.clone(),
                            error: format!("starting {depth} disk I/O threads: {e}"),
                        },
                    })?,
            ),
        };
        self.queue = queue;
        self.bounces = Default::default();
        Ok(self)
    }

    /// How the file splits and issues its transfers.
    pub fn queue(&self) -> Queue {
        self.queue
    }

    /// [`DiskFile::create`] with the I/O given: [`DiskIo::Direct`] still falls back to the
    /// page cache where the file system refuses `O_DIRECT` ([`DiskFile::io`] says which).
    pub fn create_with(dir: &Path, bytes: u64, io: DiskIo) -> Result<Self> {
        Self::make(dir, bytes, io, None)
    }

    /// [`DiskFile::create_with`], the file named for `rank` where one is given.
    fn make(dir: &Path, bytes: u64, io: DiskIo, rank: Option<u32>) -> Result<Self> {
        let bad = |problem: DiskProblem| RuntimeError::Disk {
            path: dir.to_path_buf(),
            problem,
        };
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(bad(DiskProblem::NotADirectory)),
            Err(e) => {
                return Err(bad(DiskProblem::CannotUse {
                    error: e.to_string(),
                }))
            }
        }
        let swept = sweep(dir);
        // The room first: a disk too small is refused with the figures, before a byte of
        // the file exists.
        if let Some(free) = free_bytes(dir) {
            if bytes > free {
                return Err(bad(DiskProblem::NoRoom { free, bytes }));
            }
        }
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let tag = rank.map_or(String::new(), |r| format!("-rank{r}"));
        let path = dir.join(format!("protrain-{}-{n}{tag}.state", std::process::id()));
        let create = |flags: i32| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .custom_flags(flags)
                .open(&path)
        };
        let cannot_create = |e: std::io::Error| {
            bad(DiskProblem::CannotCreate {
                file: path.clone(),
                error: e.to_string(),
            })
        };
        // Whether the file system takes `O_DIRECT` is known as the file is made: it refuses
        // the flag at open (`EINVAL`), before anything is allocated.
        let direct = match io {
            DiskIo::Direct => match create(libc::O_DIRECT) {
                Ok(file) => Some(file),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => None,
                Err(e) => return Err(cannot_create(e)),
            },
            DiskIo::Buffered => None,
        };
        let file = match direct {
            Some(_) => OpenOptions::new().read(true).write(true).open(&path),
            None => create(0),
        };
        let file = match file {
            Ok(file) => file,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(cannot_create(e));
            }
        };
        // Held until the file is closed: the mark of a live file for another run's sweep.
        // A file system without locks leaves only the PID check to protect it.
        let _ = file.try_lock();
        let disk = Self {
            file,
            direct_ok: AtomicBool::new(direct.is_some()),
            direct,
            path,
            bytes,
            swept,
            queue: Queue::SERIAL,
            pool: None,
            bounces: Default::default(),
        };
        // Allocated, not written: the file system reserves the blocks (reading as zeros) in
        // moments, where writing zeros took minutes for a large state. A failure (the disk
        // filled meanwhile) removes the file as `disk` is dropped.
        if bytes > 0 {
            use std::os::fd::AsRawFd;
            let len = libc::off_t::try_from(bytes).unwrap_or(libc::off_t::MAX);
            // SAFETY: a valid open descriptor, whole-file range from 0.
            let errno = unsafe { libc::posix_fallocate(disk.file.as_raw_fd(), 0, len) };
            if errno != 0 {
                let e = std::io::Error::from_raw_os_error(errno);
                return Err(bad(DiskProblem::CannotAllocate {
                    bytes,
                    error: e.to_string(),
                }));
            }
        }
        Ok(disk)
    }

    /// How the file moves the bulk of its bytes: [`DiskIo::Direct`] while the file system
    /// takes `O_DIRECT` transfers.
    pub fn io(&self) -> DiskIo {
        match self.direct.is_some() && self.direct_ok.load(Ordering::Relaxed) {
            true => DiskIo::Direct,
            false => DiskIo::Buffered,
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The state files of killed runs that [`DiskFile::create`] removed from the directory
    /// before making this one ([`sweep`]).
    pub fn swept(&self) -> &[PathBuf] {
        &self.swept
    }

    /// The file's size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Fails when the file is no longer at its path (deleted while the run went on): what it
    /// held is then out of reach of a checkpoint.
    pub fn check(&self) -> Result<()> {
        check(&self.path)
    }

    /// Flushes what was written to the disk itself (`fdatasync`).
    pub fn sync(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| self.io_error("syncing", 0, e))
    }

    /// Reads `out.len()` bytes at `offset`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.in_bounds(offset, out.len())?;
        self.transfer(offset, Side::Read(out), "reading")
    }

    /// Writes `data` at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.in_bounds(offset, data.len())?;
        self.transfer(offset, Side::Write(data), "writing")
    }

    /// Moves the bytes of `side` at `offset` in the requests [`requests`] plans, up to
    /// [`Queue::depth`] of them at once; `doing` names the transfer in errors. Every request
    /// runs even when one fails; the error is the lowest failed request's.
    fn transfer(&self, offset: u64, side: Side<'_>, doing: &str) -> Result<()> {
        let direct = self.direct.is_some() && self.direct_ok.load(Ordering::Relaxed);
        let plan = requests(offset, side.len(), direct, self.queue.block);
        let parts = side.split(&plan);
        let pool = match &self.pool {
            Some(pool) if parts.len() > 1 => pool,
            // One request, or one at a time: on the calling thread, in order.
            _ => {
                return parts
                    .into_iter()
                    .try_for_each(|(r, part)| self.request(offset, r, part, doing))
            }
        };
        let failed = std::sync::Mutex::new(Vec::new());
        pool.scope_fifo(|scope| {
            for (r, part) in parts {
                let failed = &failed;
                scope.spawn_fifo(move |_| {
                    if let Err(e) = self.request(offset, r, part, doing) {
                        failed
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push((r.at, e));
                    }
                });
            }
        });
        let failed = failed
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match failed.into_iter().min_by_key(|(at, _)| *at) {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Moves one request's bytes: with `O_DIRECT` (through a bounce buffer when the memory
    /// is not aligned) if the plan says so and the file system still takes it, through the
    /// page cache otherwise.
    fn request(&self, offset: u64, r: Request, mut part: Side<'_>, doing: &str) -> Result<()> {
        let pos = offset + r.at as u64;
        if let (true, Some(direct)) = (r.direct, self.direct.as_ref()) {
            if self.direct_ok.load(Ordering::Relaxed) {
                let result = match aligned(part.addr() as u64) {
                    true => match &mut part {
                        Side::Read(out) => direct.read_exact_at(out, pos),
                        Side::Write(data) => direct.write_all_at(data, pos),
                    },
                    false => self.bounced(direct, pos, &mut part),
                };
                match result {
                    Ok(()) => return Ok(()),
                    // The file system took the open but not the transfer: the page cache from
                    // now on. Nothing was half-done that the buffered path would not redo whole.
                    Err(e) if e.kind() == ErrorKind::InvalidInput => {
                        self.direct_ok.store(false, Ordering::Relaxed)
                    }
                    Err(e) => return Err(self.io_error(doing, pos, e)),
                }
            }
        }
        match &mut part {
            Side::Read(out) => self.file.read_exact_at(out, pos),
            Side::Write(data) => self.file.write_all_at(data, pos),
        }
        .map_err(|e| self.io_error(doing, pos, e))
    }

    /// An `O_DIRECT` request from or to unaligned memory, through an aligned bounce buffer
    /// taken from (and given back to) the file's.
    fn bounced(&self, direct: &File, pos: u64, part: &mut Side<'_>) -> std::io::Result<()> {
        let lock = || {
            self.bounces
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        let mut bounce = lock()
            .pop()
            .unwrap_or_else(|| Aligned::zeroed(self.queue.block));
        let buffer = &mut bounce.bytes()[..part.len()];
        let result = match part {
            Side::Read(out) => direct
                .read_exact_at(buffer, pos)
                .map(|()| out.copy_from_slice(buffer)),
            Side::Write(data) => {
                buffer.copy_from_slice(data);
                direct.write_all_at(buffer, pos)
            }
        };
        lock().push(bounce);
        result
    }

    fn in_bounds(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(RuntimeError::BadSchedule(format!(
                "{len} bytes at disk offset {offset:#x} end past the disk region of {} bytes",
                self.bytes
            ))),
        }
    }

    fn io_error(&self, doing: &str, offset: u64, e: std::io::Error) -> RuntimeError {
        let cause = match e.kind() {
            ErrorKind::StorageFull | ErrorKind::QuotaExceeded => DiskIoCause::Full,
            ErrorKind::UnexpectedEof => DiskIoCause::Truncated,
            _ => DiskIoCause::Other,
        };
        RuntimeError::Disk {
            path: self.path.clone(),
            problem: DiskProblem::Io {
                doing: doing.to_string(),
                offset,
                error: e.to_string(),
                cause,
                bytes: self.bytes,
            },
        }
    }
}

/// The memory side of a transfer.
enum Side<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl<'a> Side<'a> {
    /// The parts of the memory each request of `plan` moves, in order.
    fn split(self, plan: &[Request]) -> Vec<(Request, Side<'a>)> {
        let mut parts = Vec::with_capacity(plan.len());
        match self {
            Side::Read(mut rest) => {
                for r in plan {
                    let (part, tail) = std::mem::take(&mut rest).split_at_mut(r.len);
                    parts.push((*r, Side::Read(part)));
                    rest = tail;
                }
            }
            Side::Write(mut rest) => {
                for r in plan {
                    let (part, tail) = rest.split_at(r.len);
                    parts.push((*r, Side::Write(part)));
                    rest = tail;
                }
            }
        }
        parts
    }

    fn len(&self) -> usize {
        match self {
            Side::Read(out) => out.len(),
            Side::Write(data) => data.len(),
        }
    }

    fn addr(&self) -> usize {
        match self {
            Side::Read(out) => out.as_ptr() as usize,
            Side::Write(data) => data.as_ptr() as usize,
        }
    }
}

/// Sequential bandwidths of the disk tier's file I/O in a directory, bytes per second, moved
/// as the runtime moves a chunk's state ([`DiskFile::read`], [`DiskFile::write`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DiskBandwidth {
    /// Reads of `block` bytes, one after another (with `O_DIRECT` from the disk itself; with
    /// buffered I/O a file just written may be read from memory, as the runtime would).
    pub read: f64,
    /// Writes of `block` bytes, one after another, then `fdatasync`: what reaches the disk.
    pub write: f64,
    /// How the bytes moved.
    pub io: DiskIo,
}

/// Measures [`DiskBandwidth`] in `dir` with a file of `bytes` written and read in blocks of
/// `block` bytes (a chunk's state is read and written whole, so use about that much), with
/// the I/O the runtime uses for a state larger than the page cache (`O_DIRECT` unless
/// [`IO_ENV`] says `buffered`) and its requests in flight ([`Queue::from_env`]); the file is
/// removed after. Fails as [`DiskFile::create`] does.
pub fn measure(dir: &Path, bytes: u64, block: usize) -> Result<DiskBandwidth> {
    let block = block.max(1);
    // As the runtime moves a state the page cache cannot hold: the case the disk tier is for.
    let queue = Queue::from_env()?;
    let file = DiskFile::create_with(dir, bytes, DiskIo::from_env(u64::MAX)?)?.with_queue(queue)?;
    file.sync()?;
    let mut buffer = Aligned::zeroed(block.min(bytes as usize));
    let buffer = buffer.bytes();
    buffer.fill(0x5a);
    let started = std::time::Instant::now();
    let mut at = 0u64;
    while at < bytes {
        let n = (bytes - at).min(block as u64) as usize;
        file.write(at, &buffer[..n])?;
        at += n as u64;
    }
    file.sync()?;
    let write = bytes as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let started = std::time::Instant::now();
    let mut at = 0u64;
    while at < bytes {
        let n = (bytes - at).min(block as u64) as usize;
        file.read(at, &mut buffer[..n])?;
        at += n as u64;
    }
    let read = bytes as f64 / started.elapsed().as_secs_f64().max(1e-9);
    Ok(DiskBandwidth {
        read,
        write,
        io: file.io(),
    })
}

/// Bytes an unprivileged process may still allocate in the file system of `dir`
/// (`statvfs`: available blocks times the fragment size); `None` when it cannot be asked.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: a NUL-terminated path and a buffer of the struct's size, filled on success.
    if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: `statvfs` returned 0, so it filled the struct.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
    Some(u64::from(st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Fails when the disk tier's file `path` is gone (see [`DiskFile::check`]).
pub fn check(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(()),
        Err(e) => Err(RuntimeError::Disk {
            path: path.to_path_buf(),
            problem: DiskProblem::Vanished {
                error: e.to_string(),
            },
        }),
    }
}

/// Whether `name` is the name [`DiskFile::create`] gives its files: `protrain-PID-N.state`,
/// or `protrain-PID-N-rankR.state` for a rank ([`DiskFile::create_for_rank`]). Returns the
/// PID.
fn state_file_pid(name: &str) -> Option<u32> {
    let (pid, n) = name
        .strip_prefix("protrain-")?
        .strip_suffix(".state")?
        .split_once('-')?;
    let n = match n.split_once("-rank") {
        Some((n, rank)) => {
            rank.parse::<u32>().ok()?;
            n
        }
        None => n,
    };
    n.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// Removes from `dir` the state files that no live run holds: left by runs killed before
/// they could remove their own (what they held lives on in their checkpoints, never in this
/// file). A file counts as left when its name is one [`DiskFile::create`] gives, it is a plain
/// file, no process holds its lock, and the process that made it (the PID in its name) is not
/// running on this machine (checked through `/proc` where there is one; the lock alone
/// decides elsewhere). Returns the paths removed; files it cannot open, lock or remove are
/// left alone, since they are not provably stale.
pub fn sweep(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let proc_here = Path::new("/proc/self").exists();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(state_file_pid) else {
            continue;
        };
        let path = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        if proc_here && Path::new("/proc").join(pid.to_string()).exists() {
            continue;
        }
        let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) else {
            continue;
        };
        if file.try_lock().is_ok() && std::fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed.sort();
    removed
}

impl Drop for DiskFile {
    fn drop(&mut self) {
        // Nothing else holds the path: the state lives on only in checkpoints, which copy it.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_zeroed_written_read_and_removed() {
        let dir = std::env::temp_dir();
        let disk = DiskFile::create(&dir, 10_000).unwrap();
        let path = disk.path().to_path_buf();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 10_000);
        let mut out = [7u8; 16];
        disk.read(9_984, &mut out).unwrap();
        assert_eq!(out, [0; 16]);
        disk.write(100, &[1, 2, 3]).unwrap();
        let mut back = [0u8; 3];
        disk.read(100, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3]);
        assert!(disk.read(9_999, &mut out).is_err(), "past the end");
        drop(disk);
        assert!(!path.exists(), "removed on drop");
    }

    /// Random writes and reads of every alignment (offset, length, memory) through `io` with
    /// `queue`, against a plain byte vector: `O_DIRECT`'s blocks, the bounce buffers (a
    /// transfer over [`BLOCK`] from unaligned memory), the buffered tail and the requests in
    /// flight at once must agree with it.
    fn round_trips(io: DiskIo, queue: Queue) -> DiskIo {
        let bytes = 3 * BLOCK as u64 + 12_345;
        let dir = tempfile::tempdir().unwrap();
        let disk = DiskFile::create_with(dir.path(), bytes, io)
            .unwrap()
            .with_queue(queue)
            .unwrap();
        let mut model = vec![0u8; bytes as usize];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |below: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            (state >> 33) % below
        };
        let mut memory = Aligned::zeroed(BLOCK + 2 * DIRECT_ALIGN + 64);
        let memory = memory.bytes();
        for round in 0..60 {
            let offset = match next(3) {
                0 => next(bytes / DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64,
                _ => next(bytes),
            };
            let room = (bytes - offset) as usize;
            let len = match next(4) {
                0 => (BLOCK + DIRECT_ALIGN + 7).min(room),
                1 => (DIRECT_ALIGN * next(5) as usize).min(room),
                _ => (next(3 * DIRECT_ALIGN as u64) as usize).min(room),
            };
            // Aligned memory, or one byte off, or somewhere else off.
            let shift = [0, 1, 8 + next(56) as usize][next(3) as usize];
            let at = &mut memory[shift..shift + len];
            if round % 2 == 0 {
                for (i, b) in at.iter_mut().enumerate() {
                    *b = (i as u64 ^ offset ^ round) as u8;
                }
                disk.write(offset, at).unwrap();
                model[offset as usize..offset as usize + len].copy_from_slice(at);
            } else {
                disk.read(offset, at).unwrap();
                assert_eq!(
                    at,
                    &model[offset as usize..offset as usize + len],
                    "round {round}"
                );
            }
        }
        let mut whole = vec![0u8; bytes as usize];
        disk.read(0, &mut whole).unwrap();
        assert!(whole == model, "the whole file reads back as written");
        assert!(
            std::fs::read(disk.path()).unwrap() == model,
            "and through another handle"
        );
        disk.io()
    }

    /// One request at a time; the default depth; and small requests, many in flight.
    const QUEUES: [Queue; 3] = [
        Queue::SERIAL,
        Queue {
            depth: DEPTH,
            block: BLOCK,
        },
        Queue {
            depth: 3,
            block: 3 * DIRECT_ALIGN,
        },
    ];

    #[test]
    fn direct_and_buffered_io_read_back_every_alignment_as_written() {
        for queue in QUEUES {
            assert_eq!(round_trips(DiskIo::Buffered, queue), DiskIo::Buffered);
            // Direct where the file system takes it; either way the bytes must be right.
            let io = round_trips(DiskIo::Direct, queue);
            eprintln!("the temporary directory's file system does {io:?} I/O ({queue:?})");
        }
    }

    /// The plan of every alignment and size: the requests cover the transfer in order, none
    /// over a block; the `O_DIRECT` ones are whole aligned blocks starting a whole number of
    /// blocks in, and only a tail under one [`DIRECT_ALIGN`] block goes through the page cache
    /// (all of it when the offset is unaligned or `O_DIRECT` is out); no plan has a request
    /// more than it needs.
    #[test]
    fn requests_cover_every_alignment_and_size_in_whole_blocks() {
        let a = DIRECT_ALIGN;
        for block in [a, 3 * a, BLOCK] {
            let offsets =
                [0, 1, 7, a - 1, a, a + 1, 5 * a, 5 * a + 3, 3 * block / 2].map(|o| o as u64);
            let lens = [
                0,
                1,
                a - 1,
                a,
                a + 1,
                2 * a + 17,
                block - 1,
                block,
                block + 1,
                block + a,
                3 * block + 5,
            ];
            for (offset, len, direct) in cases(&offsets, &lens) {
                let plan = requests(offset, len, direct, block);
                let what = format!("offset {offset} len {len} direct {direct} block {block}");
                let mut at = 0;
                for r in &plan {
                    assert_eq!(r.at, at, "{what}: contiguous, in order: {plan:?}");
                    assert!(r.len > 0 && r.len <= block, "{what}: {plan:?}");
                    at += r.len;
                }
                assert_eq!(at, len, "{what}: covers the transfer: {plan:?}");
                let goes_direct = direct && aligned(offset);
                let whole = match goes_direct {
                    true => len / a * a,
                    false => 0,
                };
                for r in &plan {
                    match r.direct {
                        true => {
                            assert!(goes_direct && r.at + r.len <= whole, "{what}: {plan:?}");
                            assert!(
                                aligned(offset + r.at as u64) && aligned(r.len as u64),
                                "{what}: O_DIRECT takes whole aligned blocks: {plan:?}"
                            );
                        }
                        false => assert!(r.at >= whole, "{what}: {plan:?}"),
                    }
                    if r.at < whole || !goes_direct {
                        assert_eq!(r.at % block, 0, "{what}: starts on a block: {plan:?}");
                    }
                }
                assert!(len - whole < a || !goes_direct, "{what}: {plan:?}");
                let want = whole.div_ceil(block) + (len - whole).div_ceil(block);
                assert_eq!(plan.len(), want, "{what}: no more requests than needed");
            }
        }
    }

    /// Every (offset, length, direct) of the three lists.
    fn cases(offsets: &[u64], lens: &[usize]) -> Vec<(u64, usize, bool)> {
        let mut all = Vec::new();
        for &o in offsets {
            for &l in lens {
                for d in [false, true] {
                    all.push((o, l, d));
                }
            }
        }
        all
    }

    /// A read that runs past a file truncated under it fails in several requests at once; the
    /// error names the file and the offset of the lowest one, at every depth, and the
    /// requests before it still delivered their bytes.
    #[test]
    fn a_failed_request_names_the_file_and_its_offset() {
        let a = DIRECT_ALIGN;
        for io in [DiskIo::Direct, DiskIo::Buffered] {
            for depth in [1, 2, 4, 8] {
                let dir = tempfile::tempdir().unwrap();
                let queue = Queue { depth, block: a };
                let disk = DiskFile::create_with(dir.path(), 16 * a as u64, io)
                    .unwrap()
                    .with_queue(queue)
                    .unwrap();
                let data: Vec<u8> = (0..16 * a).map(|i| (i % 251) as u8).collect();
                disk.write(0, &data).unwrap();
                OpenOptions::new()
                    .write(true)
                    .open(disk.path())
                    .unwrap()
                    .set_len(5 * a as u64 + 100)
                    .unwrap();
                let mut out = vec![0u8; 12 * a];
                let e = disk.read(0, &mut out).unwrap_err().to_string();
                let what = format!("{io:?} at depth {depth}");
                assert!(
                    e.contains(&disk.path().display().to_string())
                        && e.contains("reading at offset 0x5000")
                        && e.contains("truncated"),
                    "{what}: {e}"
                );
                assert!(
                    out[..5 * a] == data[..5 * a],
                    "{what}: the blocks before it"
                );
            }
        }
    }

    #[test]
    fn the_queue_depth_is_a_small_whole_number() {
        assert_eq!(Queue::parse(None).unwrap().depth, DEPTH);
        assert_eq!(Queue::parse(Some("1")).unwrap(), Queue::SERIAL);
        assert_eq!(Queue::parse(Some(" 16 ")).unwrap().depth, 16);
        for bad in ["0", "65", "-1", "many"] {
            let e = Queue::parse(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(&format!("PROTRAIN_DISK_QUEUE={bad}")) && e.contains("from 1"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn the_io_mode_is_named_and_a_bad_one_is_refused() {
        assert_eq!(DiskIo::parse(None).unwrap(), None);
        assert_eq!(DiskIo::parse(Some("auto")).unwrap(), None);
        assert_eq!(DiskIo::parse(Some("direct")).unwrap(), Some(DiskIo::Direct));
        assert_eq!(
            DiskIo::parse(Some("buffered")).unwrap(),
            Some(DiskIo::Buffered)
        );
        let e = DiskIo::parse(Some("fast")).unwrap_err().to_string();
        assert!(
            e.contains("PROTRAIN_DISK_IO=fast") && e.contains("buffered"),
            "{e}"
        );
        // Auto: the page cache for what it can hold, O_DIRECT past half the memory.
        let gib = 1u64 << 30;
        assert_eq!(DiskIo::auto(gib, Some(2 * gib)), DiskIo::Buffered);
        assert_eq!(DiskIo::auto(gib + 1, Some(2 * gib)), DiskIo::Direct);
        assert_eq!(DiskIo::auto(1, None), DiskIo::Direct);
    }

    /// The PID of a process that has exited (and been waited for).
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    fn a_killed_runs_file_is_swept_and_a_held_or_foreign_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let pid = dead_pid();
        let left = dir.path().join(format!("protrain-{pid}-0.state"));
        let held = dir.path().join(format!("protrain-{pid}-1.state"));
        let foreign = [
            "protrain-x-0.state",
            "protrain-1-0.state.tmp",
            "notes.state",
        ];
        std::fs::write(&left, b"left by kill -9").unwrap();
        std::fs::write(&held, b"still in use").unwrap();
        for name in foreign {
            std::fs::write(dir.path().join(name), b"not ours").unwrap();
        }
        let holder = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&held)
            .unwrap();
        holder.try_lock().unwrap();
        let disk = DiskFile::create(dir.path(), 64).unwrap();
        assert_eq!(disk.swept(), std::slice::from_ref(&left));
        assert!(!left.exists() && held.exists());
        for name in foreign {
            assert!(dir.path().join(name).exists(), "{name} is not a state file");
        }
        // Another run's sweep leaves this live file (held, and made by a live process).
        assert!(sweep(dir.path()).is_empty());
        assert!(disk.path().exists());
        drop(holder);
        assert_eq!(sweep(dir.path()), [held]);
    }

    /// Each rank's file is named for it; a killed run's rank files are swept as any other,
    /// and a live rank's file is not.
    #[test]
    fn a_ranks_file_is_named_for_it_and_swept_after_a_killed_run() {
        let dir = tempfile::tempdir().unwrap();
        let pid = dead_pid();
        let left: Vec<PathBuf> = (0..2)
            .map(|r| dir.path().join(format!("protrain-{pid}-{r}-rank{r}.state")))
            .collect();
        for path in &left {
            std::fs::write(path, b"left by kill -9").unwrap();
        }
        let odd = dir.path().join(format!("protrain-{pid}-0-rankx.state"));
        std::fs::write(&odd, b"not ours").unwrap();
        let disk = DiskFile::create_for_rank(dir.path(), 64, Some(1)).unwrap();
        let name = disk
            .path()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned();
        assert!(
            name.starts_with(&format!("protrain-{}-", std::process::id()))
                && name.ends_with("-rank1.state"),
            "{name}"
        );
        assert_eq!(disk.swept(), &left[..]);
        assert!(
            odd.exists(),
            "a name with no rank number is not a state file"
        );
        let other = DiskFile::create_for_rank(dir.path(), 64, Some(0)).unwrap();
        assert!(other.swept().is_empty() && disk.path().exists());
        let path = disk.path().to_path_buf();
        drop(disk);
        assert!(!path.exists());
    }

    #[test]
    fn bandwidths_are_measured_in_a_directory() {
        let bw = measure(&std::env::temp_dir(), 4 << 20, 1 << 20).unwrap();
        assert!(bw.read.is_finite() && bw.read > 0.0, "{bw:?}");
        assert!(bw.write.is_finite() && bw.write > 0.0, "{bw:?}");
    }

    #[test]
    fn a_missing_directory_and_a_vanished_file_are_named() {
        let missing = std::env::temp_dir().join("protrain-no-such-dir-for-disk-test");
        let e = DiskFile::create(&missing, 16).unwrap_err().to_string();
        assert!(
            e.contains("protrain-no-such-dir") && e.contains("mkdir") && e.contains("disk_dir"),
            "{e}"
        );
        let disk = DiskFile::create(&std::env::temp_dir(), 16).unwrap();
        disk.check().unwrap();
        std::fs::remove_file(disk.path()).unwrap();
        let e = disk.check().unwrap_err().to_string();
        assert!(
            e.contains("vanished") && e.contains("(resume)") && !e.contains("--"),
            "{e}"
        );
    }
}
