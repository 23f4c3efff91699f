//! Paths of the test model and golden data, shared by the workspace's tests.

use std::path::PathBuf;

/// The workspace root: `$DUET_WORKSPACE`, else the checkout the tests were built in.
pub fn workspace_root() -> PathBuf {
    // Test binaries run elsewhere (the GPU check) are told where the checkout is.
    if let Some(dir) = std::env::var_os("DUET_WORKSPACE") {
        return dir.into();
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// The default model: `$DUET_MODEL`, else `models/SmolLM2-135M-Instruct.Q4_1.gguf`. Panics
/// with the fetch command when it is missing, so a test never passes without its model.
pub fn model_path() -> PathBuf {
    let path = std::env::var_os("DUET_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(crate::DEFAULT_MODEL_PATH));
    assert!(path.exists(), "test model {} is missing: run scripts/fetch-model.sh", path.display());
    path
}

/// A file of the llama.cpp reference data in `testdata/golden/`.
pub fn golden(name: &str) -> PathBuf {
    workspace_root().join("testdata/golden").join(name)
}
