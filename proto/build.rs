//! Generates the gRPC code of `proto/duet/v1/*.proto` with a vendored protoc (no system
//! protoc needed), plus the descriptor set that server reflection serves.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let files = ["duet/v1/inference.proto", "duet/v1/worker.proto"].map(|f| root.join(f));
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let descriptors = PathBuf::from(std::env::var("OUT_DIR")?).join("duet_descriptor.bin");
    tonic_prost_build::configure().file_descriptor_set_path(descriptors).compile_protos(&files, &[root])?;
    Ok(())
}
