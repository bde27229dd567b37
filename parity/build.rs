//! With the `llama-cpp` feature, the worker finds the llama.cpp libraries the binding built (shared, so that ggml's
//! CPU variants load at run time) through an rpath to them, as `cargo run` would through its library path.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_LLAMA_CPP").is_none() {
        return;
    }
    // The binding's `backends_dir` metadata is `<its OUT_DIR>/backends`; its libraries are in `<OUT_DIR>/lib`.
    if let Some(backends) = std::env::var_os("DEP_LLAMA_BACKENDS_DIR") {
        let out = std::path::Path::new(&backends)
            .parent()
            .expect("the binding's OUT_DIR");
        println!(
            "cargo:rustc-link-arg-bin=qwen35-llama-worker=-Wl,-rpath,{}",
            out.join("lib").display()
        );
    }
}
