//! Finding the CUDA libraries at run time. cudarc opens them by name on first use and panics
//! when one is missing, so they are checked (and, from the usual install folders, preloaded)
//! before anything touches CUDA.

use std::path::PathBuf;
use std::sync::OnceLock;

/// What the backend needs: (what it is, file names to try).
const LIBRARIES: &[(&str, &[&str])] = &[
    ("the CUDA driver (libcuda)", &["libcuda.so.1", "libcuda.so"]),
    ("NVRTC (libnvrtc)", &["libnvrtc.so.13", "libnvrtc.so"]),
    ("cuBLAS (libcublas)", &["libcublas.so.13", "libcublas.so"]),
    (
        "cuBLASLt (libcublasLt)",
        &["libcublasLt.so.13", "libcublasLt.so"],
    ),
];

/// Folders tried besides the loader's own search path.
fn extra_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(home) = std::env::var_os("CUDA_HOME").or_else(|| std::env::var_os("CUDA_PATH")) {
        dirs.push(PathBuf::from(home).join("lib64"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs.push(PathBuf::from("/usr/local/cuda/targets/x86_64-linux/lib"));
    dirs.push(PathBuf::from("/usr/lib/x86_64-linux-gnu"));
    dirs
}

fn open(name: &str) -> bool {
    // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions.
    let found = |path: &std::ffi::OsStr| unsafe {
        libloading::os::unix::Library::open(
            Some(path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    };
    if let Ok(lib) = found(name.as_ref()) {
        std::mem::forget(lib); // stays loaded for the life of the process
        return true;
    }
    for dir in extra_dirs() {
        let path = dir.join(name);
        if path.exists() {
            if let Ok(lib) = found(path.as_os_str()) {
                std::mem::forget(lib);
                return true;
            }
        }
    }
    false
}

/// Loads NVRTC alone (enough to compile the kernels, no GPU needed).
pub fn ensure_nvrtc() -> Result<(), String> {
    if LIBRARIES[1].1.iter().any(|n| open(n)) {
        Ok(())
    } else {
        Err("NVRTC (libnvrtc.so.13) not found: install the `nvidia-cuda-nvrtc==13.0.88` wheel and put \
             its lib folder on LD_LIBRARY_PATH (`.ci/run` does both), or install the CUDA toolkit"
            .into())
    }
}

/// Loads every CUDA library the backend needs, or says which are missing.
pub fn ensure_loaded() -> Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            let missing: Vec<&str> = LIBRARIES
                .iter()
                .filter(|(_, names)| !names.iter().any(|n| open(n)))
                .map(|(what, _)| *what)
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "CUDA is not usable here: could not load {} (looked on the library path, in \
                     $CUDA_HOME/lib64 and /usr/local/cuda/lib64; set LD_LIBRARY_PATH to the folder \
                     holding them)",
                    missing.join(", ")
                ))
            }
        })
        .clone()
}
