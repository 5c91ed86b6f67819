//! The kernel sources under `kernels/`: each `.cu` file is one NVRTC program (one CUDA module),
//! and includes the shared headers by name (`#include "common/types.cuh"`), which NVRTC is given
//! in memory, so nothing is read from disk at run time.

use cudarc::nvrtc::{result, sys};
use std::ffi::{c_char, c_int, CString};

/// (path under `kernels/`, text) of each listed file.
macro_rules! kernel_sources {
    ($($path:literal),* $(,)?) => {
        &[$(($path, include_str!(concat!("../kernels/", $path)))),*]
    };
}

/// The headers, by the name the sources include them by (their path under `kernels/`).
pub const HEADERS: &[(&str, &str)] = kernel_sources![
    "common/types.cuh",
    "common/fp8.cuh",
    "common/mma.cuh",
    "common/rows.cuh",
    "common/head_norm.cuh",
    "lightning/common.cuh",
    "sparse/common.cuh",
    "gemv/common.cuh",
];

/// The kernel files (path under `kernels/`, text); each is compiled on its own.
pub const FILES: &[(&str, &str)] = kernel_sources![
    "elementwise.cu",
    "gemv/bf16.cu",
    "gemv/rows64.cu",
    "gemv/w4.cu",
    "gemv/fp8.cu",
    "lightning/decode.cu",
    "lightning/chunked.cu",
    "lightning/split.cu",
    "lightning/ranges.cu",
    "lightning/context.cu",
    "sparse/compress.cu",
    "sparse/select_exact.cu",
    "sparse/select_scores.cu",
    "sparse/select_wgmma.cu",
    "sparse/select_decode.cu",
    "sparse/attention.cu",
    "sparse/attention_walk.cu",
];

/// The text of kernel file `file` (a path of [`FILES`]).
pub fn text(file: &str) -> Option<&'static str> {
    FILES.iter().find(|(f, _)| *f == file).map(|(_, t)| *t)
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn c_text(bytes: Vec<c_char>) -> String {
    let bytes: Vec<u8> = bytes.into_iter().map(|c| c as u8).collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Compiles kernel file `file` (a path of [`FILES`]) to PTX for the virtual architecture
/// `target` (e.g. `compute_80`, `compute_90a`), with [`HEADERS`] in memory. NVRTC must be
/// loaded ([`crate::libs::ensure_nvrtc`]).
pub fn compile(file: &str, target: &str) -> Result<String, String> {
    let fail = |what: String| format!("NVRTC, {file} for {target}: {what}");
    let src = text(file).ok_or_else(|| fail("no such kernel file".into()))?;
    let cstr = |s: &str| CString::new(s).map_err(|_| fail("a NUL byte in a source".into()));
    let src = cstr(src)?;
    let name = cstr(file)?;
    let header_texts = HEADERS
        .iter()
        .map(|(_, t)| cstr(t))
        .collect::<Result<Vec<_>, _>>()?;
    let header_names = HEADERS
        .iter()
        .map(|(n, _)| cstr(n))
        .collect::<Result<Vec<_>, _>>()?;
    let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|s| s.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: the pointers are to NUL-terminated strings (arrays of HEADERS.len() of them), the
    // CStrings above, which are declared before `prog` and so outlive it (NVRTC may keep
    // pointing at them until the program is destroyed).
    unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            HEADERS.len() as c_int,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    }
    .result()
    .map_err(|e| fail(format!("creating the program: {e:?}")))?;
    let prog = Program(prog);
    let options = [
        format!("--gpu-architecture={target}"),
        "--std=c++17".to_string(),
    ];
    // SAFETY: `prog` is a live program; the options are copied for the call.
    if let Err(e) = unsafe { result::compile_program(prog.0, &options) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog.0) }.map(c_text);
        return Err(fail(format!(
            "{e:?}\n{}",
            log.unwrap_or_else(|e| format!("(no log: {e:?})"))
        )));
    }
    // SAFETY: as above; the program compiled.
    let ptx = unsafe { result::get_ptx(prog.0) }.map_err(|e| fail(format!("{e:?}")))?;
    Ok(c_text(ptx))
}

/// The `extern "C" __global__` entry points of a source text, in order.
pub fn entry_points(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("extern \"C\" __global__") {
        rest = &rest[at + "extern \"C\" __global__".len()..];
        // Skip `void` and `__launch_bounds__(...)`: the name is the last word before the '('
        // that opens the parameters.
        let mut head = rest;
        if let Some(lb) = head.find("__launch_bounds__") {
            if lb < head.find('(').unwrap_or(0) {
                head = &head[lb..];
                head = &head[head.find(')').map_or(head.len(), |p| p + 1)..];
            }
        }
        if let Some(open) = head.find('(') {
            if let Some(name) = head[..open].split_whitespace().last() {
                out.push(name);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_files_are_included_by_their_names() {
        let known: Vec<&str> = HEADERS.iter().map(|(n, _)| *n).collect();
        for (file, text) in FILES.iter().chain(HEADERS) {
            for line in text.lines() {
                if let Some(rest) = line.trim_start().strip_prefix("#include") {
                    let name = rest.trim().trim_matches('"');
                    assert!(known.contains(&name), "{file} includes unknown {rest}");
                }
            }
        }
        for (name, text) in HEADERS {
            assert!(text.contains("#pragma once"), "{name} has no include guard");
        }
    }

    #[test]
    fn entry_points_are_found() {
        let src = "extern \"C\" __global__ void a(int x) {}\n\
                   extern \"C\" __global__ void __launch_bounds__(32 * W, 2)\nb_2(const int* p) {}";
        assert_eq!(entry_points(src), ["a", "b_2"]);
    }
}
