//! The kernel registry: each kernel file ([`crate::sources`]) compiled by NVRTC into its own
//! module, cached on disk by (file, headers, target, NVRTC version), and loaded; the kernels
//! are found in them by the table of [`crate::kernels`].
//!
//! NVRTC rather than an ahead-of-time fatbin: the one `sala` binary then builds for whatever
//! GPU it finds (sm_90a on Hopper, the plain target elsewhere) with no CUDA toolkit at build
//! time, and the on-disk cache keeps later start-ups fast.

use crate::sources;
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::Ptx;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

fn cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("sala")
        .join("kernels")
}

/// `f` of every kernel file (a path of [`sources::FILES`]), on as many threads as there are
/// cores, the largest files first; the results in the order of `FILES`, or all the errors.
fn for_each_file<T: Send>(
    f: impl Fn(&'static str) -> Result<T, String> + Sync,
) -> Result<Vec<(&'static str, T)>, String> {
    let files = sources::FILES;
    let mut order: Vec<usize> = (0..files.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(files[i].1.len()));
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(files.len());
    let next = AtomicUsize::new(0);
    let mut results: Vec<Option<Result<T, String>>> = files.iter().map(|_| None).collect();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                        done.push((i, f(files[i].0)));
                    }
                    done
                })
            })
            .collect();
        for w in workers {
            let done = w.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            for (i, r) in done {
                results[i] = Some(r);
            }
        }
    });
    let mut out = Vec::with_capacity(files.len());
    let mut errors = Vec::new();
    for ((file, _), r) in files.iter().zip(results) {
        match r.expect("every file was taken by a thread") {
            Ok(t) => out.push((*file, t)),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors.join("\n"))
    }
}

/// Every kernel file compiled to PTX for `target` (in parallel, no cache), in the order of
/// [`sources::FILES`].
pub fn compile_all(target: &str) -> Result<Vec<(&'static str, String)>, String> {
    for_each_file(|file| sources::compile(file, target))
}

/// PTX of kernel file `file` for `target`, from the disk cache or freshly compiled (and then
/// cached). The cache key covers the file, every header, the target and the NVRTC version.
pub fn ptx_for(file: &str, target: &str) -> Result<String, String> {
    let text = sources::text(file).ok_or_else(|| format!("no kernel file {file}"))?;
    let mut h = DefaultHasher::new();
    (file, text).hash(&mut h);
    sources::HEADERS.hash(&mut h);
    target.hash(&mut h);
    nvrtc_version().hash(&mut h);
    let stem = file.trim_end_matches(".cu").replace('/', "-");
    let path = cache_dir().join(format!("{target}-{stem}-{:016x}.ptx", h.finish()));
    if let Ok(ptx) = std::fs::read_to_string(&path) {
        return Ok(ptx);
    }
    let ptx = sources::compile(file, target)?;
    // The cache is an optimisation: failing to write it is not an error.
    if std::fs::create_dir_all(cache_dir()).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(ptx)
}

/// Every kernel file's module for `target` (PTX from [`ptx_for`]), compiled and loaded in
/// parallel, in the order of [`sources::FILES`].
pub fn load_modules(
    ctx: &Arc<CudaContext>,
    target: &str,
) -> Result<Vec<(&'static str, Arc<CudaModule>)>, String> {
    for_each_file(|file| {
        let ptx = ptx_for(file, target)?;
        ctx.load_module(Ptx::from_src(ptx))
            .map_err(|e| format!("loading the module of {file}: {e:?}"))
    })
}
