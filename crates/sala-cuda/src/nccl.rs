//! NCCL, the communication layer between the GPUs of one host (tensor and context
//! parallelism), loaded at run time. cudarc's own NCCL loader (0.19) looks for `libnccl.so` and
//! `libnccl.so.{13,12,11,10,9,1}`, never NCCL's soname `libnccl.so.2` (the only name the
//! `nvidia-nccl` wheels ship), and panics when none loads; so the few calls used here are bound
//! by that name, with an error that says what is missing. One process drives every GPU (a
//! thread each): its communicators come from one `ncclCommInitAll`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

type NcclResult = c_int;
type RawComm = *mut c_void;
/// `ncclBfloat16` and `ncclFloat32` of `ncclDataType_t`, `ncclSum` of `ncclRedOp_t`.
const BF16: c_int = 9;
const F32: c_int = 7;
const SUM: c_int = 0;

type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    *mut c_void,
) -> NcclResult;

type SendRecv =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> NcclResult;

/// The loaded library and the calls this crate makes.
pub struct Nccl {
    path: PathBuf,
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    comm_init_all: unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    all_reduce: AllReduce,
    send: SendRecv,
    recv: SendRecv,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    _lib: libloading::Library,
}

/// Folders tried for `libnccl.so.2` besides the loader's own search path: `$SALA_NCCL_DIR`,
/// the CUDA folders, and the `nvidia/nccl/lib` folders of Python installs (PyTorch's NCCL).
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("SALA_NCCL_DIR")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        dirs.push(PathBuf::from(home).join("lib64"));
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/lib/x86_64-linux-gnu".into());
    let mut lib_roots: Vec<PathBuf> = vec![
        "/usr/local/lib".into(),
        "/usr/lib".into(),
        "/opt/conda/lib".into(),
    ];
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = std::env::var_os(var) {
            lib_roots.push(PathBuf::from(p).join("lib"));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        lib_roots.push(PathBuf::from(home).join(".local/lib"));
    }
    for root in lib_roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("python3") {
                for site in ["site-packages", "dist-packages"] {
                    dirs.push(e.path().join(site).join("nvidia/nccl/lib"));
                }
            }
        }
    }
    dirs
}

/// NCCL, loaded once: an error naming the library and how to get it where it is missing.
pub fn load() -> Result<&'static Nccl, String> {
    static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(open).as_ref().map_err(Clone::clone)
}

fn open() -> Result<Nccl, String> {
    const NAME: &str = "libnccl.so.2";
    let mut tried = vec![PathBuf::from(NAME)];
    tried.extend(search_dirs().into_iter().map(|d| d.join(NAME)));
    for path in &tried {
        if path.components().count() > 1 && !path.exists() {
            continue;
        }
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
        let Ok(lib) = (unsafe { libloading::Library::new(path) }) else {
            continue;
        };
        return bind(lib, path.clone());
    }
    Err(format!(
        "NCCL ({NAME}) not found: several GPUs need it. Install it (e.g. `pip install \
         nvidia-nccl-cu13`, or the libnccl2 package) and put the folder holding {NAME} on \
         LD_LIBRARY_PATH or in SALA_NCCL_DIR (looked on the library path and in {} folders)",
        tried.len() - 1
    ))
}

fn bind(lib: libloading::Library, path: PathBuf) -> Result<Nccl, String> {
    // SAFETY: each symbol is NCCL's C function of that name, with the signature of nccl.h.
    unsafe {
        macro_rules! sym {
            ($name:literal) => {
                *lib.get($name).map_err(|e| {
                    format!(
                        "{}: no {} ({e})",
                        path.display(),
                        String::from_utf8_lossy(&$name[..$name.len() - 1])
                    )
                })?
            };
        }
        Ok(Nccl {
            get_version: sym!(b"ncclGetVersion\0"),
            error_string: sym!(b"ncclGetErrorString\0"),
            comm_init_all: sym!(b"ncclCommInitAll\0"),
            comm_destroy: sym!(b"ncclCommDestroy\0"),
            all_reduce: sym!(b"ncclAllReduce\0"),
            send: sym!(b"ncclSend\0"),
            recv: sym!(b"ncclRecv\0"),
            group_start: sym!(b"ncclGroupStart\0"),
            group_end: sym!(b"ncclGroupEnd\0"),
            path,
            _lib: lib,
        })
    }
}

impl Nccl {
    /// Where it was loaded from.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Its version, as `major.minor.patch`.
    pub fn version(&self) -> Result<String, String> {
        let mut v: c_int = 0;
        // SAFETY: NCCL writes one int.
        self.check("ncclGetVersion", unsafe { (self.get_version)(&mut v) })?;
        // NCCL 2.9 on: major·10000 + minor·100 + patch.
        Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
    }

    fn check(&self, what: &str, r: NcclResult) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any result code.
        let msg = unsafe { CStr::from_ptr((self.error_string)(r)) };
        Err(format!("{what}: {} (NCCL {r})", msg.to_string_lossy()))
    }
}

/// Communicators for the GPUs `ordinals` of this process, rank i on `ordinals[i]`.
pub struct Group {
    nccl: &'static Nccl,
    comms: Vec<RawComm>,
}

/// The element types a collective takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    Bf16,
    F32,
}

impl Elem {
    /// NCCL's `ncclDataType_t` for it.
    fn nccl_type(self) -> c_int {
        match self {
            Elem::Bf16 => BF16,
            Elem::F32 => F32,
        }
    }
}

impl Group {
    /// One communicator a GPU (`ncclCommInitAll`). NVLink multicast (NVLS) is kept off unless
    /// `NCCL_NVLS_ENABLE` says otherwise.
    pub fn all(ordinals: &[i32]) -> Result<Self, String> {
        let nccl = load()?;
        if ordinals.is_empty() {
            return Err("an NCCL group needs at least one GPU".into());
        }
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        let mut comms = vec![std::ptr::null_mut(); ordinals.len()];
        // SAFETY: `comms` has room for one communicator a listed device.
        let r = unsafe {
            (nccl.comm_init_all)(
                comms.as_mut_ptr(),
                ordinals.len() as c_int,
                ordinals.as_ptr(),
            )
        };
        nccl.check(&format!("ncclCommInitAll over GPUs {ordinals:?}"), r)?;
        Ok(Self { nccl, comms })
    }

    /// Ranks (GPUs) in the group.
    pub fn ranks(&self) -> usize {
        self.comms.len()
    }

    /// Copies `count` values of `elem` from rank `from`'s buffer to rank `to`'s: each
    /// `(rank, device address, stream)`; one grouped send and receive, queued on the two
    /// ranks' streams. Returns once queued.
    pub fn send_recv(
        &self,
        elem: Elem,
        (from, src, src_stream): (usize, u64, *mut c_void),
        (to, dst, dst_stream): (usize, u64, *mut c_void),
        count: usize,
    ) -> Result<(), String> {
        let ranks = self.comms.len();
        if from == to || from >= ranks || to >= ranks {
            return Err(format!(
                "a copy from rank {from} to rank {to} in a group of {ranks} ranks"
            ));
        }
        let ty = elem.nccl_type();
        let n = self.nccl;
        // SAFETY: a send on `from`'s communicator and stream and the matching receive on
        // `to`'s, in one group; both buffers hold `count` values.
        unsafe {
            n.check("ncclGroupStart", (n.group_start)())?;
            let sent = (n.send)(
                src as *mut c_void,
                count,
                ty,
                to as c_int,
                self.comms[from],
                src_stream,
            );
            let received = (n.recv)(
                dst as *mut c_void,
                count,
                ty,
                from as c_int,
                self.comms[to],
                dst_stream,
            );
            // The group is closed whatever happened inside it.
            let ended = n.check("ncclGroupEnd", (n.group_end)());
            n.check("ncclSend", sent)?;
            n.check("ncclRecv", received)?;
            ended
        }
    }

    /// Sums `count` values of `elem` in place across the ranks: `bufs[i]` is rank i's device
    /// buffer and the stream (`CUstream`) its reduction is queued on. Returns once queued.
    pub fn all_reduce_sum(
        &self,
        elem: Elem,
        bufs: &[(u64, *mut c_void)],
        count: usize,
    ) -> Result<(), String> {
        if bufs.len() != self.comms.len() {
            return Err(format!(
                "all-reduce over {} buffers in a group of {} ranks",
                bufs.len(),
                self.comms.len()
            ));
        }
        let ty = elem.nccl_type();
        let n = self.nccl;
        // SAFETY: one grouped call a rank, each on its own communicator and stream.
        unsafe {
            n.check("ncclGroupStart", (n.group_start)())?;
            let mut result = Ok(());
            for (&comm, &(ptr, stream)) in self.comms.iter().zip(bufs) {
                let p = ptr as *mut c_void;
                let r = (n.all_reduce)(p, p, count, ty, SUM, comm, stream);
                if result.is_ok() {
                    result = n.check("ncclAllReduce", r);
                }
            }
            // The group is closed whatever happened inside it.
            n.check("ncclGroupEnd", (n.group_end)())?;
            result
        }
    }
}

// SAFETY: the communicators are used by one thread at a time (the engine's, which owns the
// ranks); NCCL allows a communicator to move between threads.
unsafe impl Send for Group {}

impl Drop for Group {
    fn drop(&mut self) {
        for &c in &self.comms {
            // SAFETY: a communicator this group made and nothing else uses.
            unsafe { (self.nccl.comm_destroy)(c) };
        }
    }
}

#[cfg(test)]
mod tests {
    /// Where NCCL is installed, it loads and says its version; where it is not, the error
    /// names the library and how to get it (this machine may be either).
    #[test]
    fn nccl_loads_or_says_what_is_missing() {
        match super::load() {
            Ok(n) => {
                let v = n.version().unwrap();
                assert!(v.starts_with("2."), "{v}");
                assert!(n.path().to_string_lossy().contains("libnccl.so.2"));
            }
            Err(e) => {
                assert!(e.contains("libnccl.so.2"), "{e}");
                assert!(
                    e.contains("SALA_NCCL_DIR") && e.contains("LD_LIBRARY_PATH"),
                    "{e}"
                );
            }
        }
        let group = super::Group::all(&[]);
        assert!(group.is_err());
    }
}
