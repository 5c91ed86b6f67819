//! Writes the PTX NVRTC makes of one kernel file for one target, as the backend compiles it
//! (no GPU needed): what `scripts/sass-loops.sh` assembles and disassembles.
//! Usage: kernel_ptx FILE TARGET OUT   (e.g. gemv/w4.cu compute_90a /tmp/w4.ptx)

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [file, target, out] = &args[..] else {
        eprintln!("usage: kernel_ptx FILE TARGET OUT (e.g. gemv/w4.cu compute_90a /tmp/w4.ptx)");
        std::process::exit(2);
    };
    let written = sala_cuda::sources::compile(file, target)
        .and_then(|ptx| std::fs::write(out, ptx).map_err(|e| format!("{out}: {e}")));
    if let Err(e) = written {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
