//! The experts a cpu-worker serves: its share of a mixture-of-experts model's routed experts
//! (`--experts-of I/N`: the experts [`expert_owner`] gives share I of N), mapped from the GGUF
//! file and repacked on the worker's own threads, and the expert jobs it answers: each held
//! expert's gated MLP once over the rows routed to it, every item's output times its weight.

use std::path::Path;
use std::sync::Arc;

use duet_kernels::mlp::scaled;
use duet_kv::shm::expert_job::{decode_expert_job, expert_owner, write_expert_results, ExpertJob, ExpertLimits};
use duet_kv::shm::job::{caught, JobError};
use duet_model::config::LlamaConfig;
use duet_model::experts::{ExpertBank, ExpertTensors};
use duet_model::gguf::GgufFile;

use crate::CpuWorkerError;

/// Which share of the experts a worker serves: share `index` of `of`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShare {
    pub index: u32,
    pub of: u32,
}

impl std::str::FromStr for ExpertShare {
    type Err = String;

    /// `I/N`, e.g. `0/2`: share I of N (I < N).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a share I/N (e.g. 0/1, or 1/2 for the second of two)");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, of): (u32, u32) = (i.trim().parse().map_err(|_| bad())?, n.trim().parse().map_err(|_| bad())?);
        if of == 0 || index >= of {
            return Err(bad());
        }
        Ok(ExpertShare { index, of })
    }
}

/// A worker's experts and what its jobs are checked against.
pub struct ServedExperts {
    pub bank: ExpertBank,
    pub limits: ExpertLimits,
}

impl ServedExperts {
    /// Loads `share` of the routed experts of the model at `path`.
    pub fn load(path: &Path, share: ExpertShare) -> Result<Self, CpuWorkerError> {
        let model_err = |source| CpuWorkerError::Model { path: path.to_path_buf(), source };
        let file = Arc::new(GgufFile::open(path).map_err(|e| model_err(e.into()))?);
        let config = LlamaConfig::from_gguf(&file).map_err(model_err)?;
        let tensors = ExpertTensors::find(&file, &config)
            .map_err(model_err)?
            .ok_or_else(|| CpuWorkerError::Config(format!("--experts-of: {} is not a mixture-of-experts model", path.display())))?;
        let limits = ExpertLimits { n_layer: config.n_layer as u32, n_embd: config.n_embd as u32, n_expert: tensors.n_expert as u32 };
        let n_expert = tensors.n_expert as u32;
        let repack = !std::env::var("DUET_REPACK").is_ok_and(|v| v == "0");
        let bank = ExpertBank::load(file, &config, tensors, |_, e| expert_owner(e as u32, n_expert, share.of) == share.index, repack)
            .map_err(model_err)?;
        if bank.held_count() == 0 {
            return Err(CpuWorkerError::Config(format!("--experts-of {}/{}: no expert of {n_expert} falls to this share", share.index, share.of)));
        }
        Ok(ServedExperts { bank, limits })
    }
}

/// Decodes the expert job in `slot`, computes it and writes its results; a malformed job,
/// an expert this worker does not hold, or a panic becomes an error for the slot.
pub fn answer(slot: &mut [u8], experts: Option<&ServedExperts>) -> Result<(), JobError> {
    let experts = experts.ok_or(JobError::NoExperts)?;
    let job = decode_expert_job(slot, &experts.limits)?;
    if let Some((item, it)) = job.items.iter().enumerate().find(|(_, it)| !experts.bank.holds(job.layer as usize, it.expert as usize)) {
        return Err(JobError::BadExpert { item, expert: it.expert, reason: "not one this cpu-worker serves" });
    }
    let out = caught(|| compute(&job, &experts.bank))?;
    write_expert_results(slot, &job, &out)
}

/// Every item's expert output times its weight, `[item][n_embd]`: each expert once over the
/// rows routed to it (the experts in parallel, each product parallel inside).
pub fn compute(job: &ExpertJob, bank: &ExpertBank) -> Vec<f32> {
    let d = job.n_embd as usize;
    let mut experts: Vec<u32> = job.items.iter().map(|it| it.expert).collect();
    experts.sort_unstable();
    experts.dedup();
    // Per expert: the items routed to it, and their rows.
    let items: Vec<Vec<usize>> = experts.iter().map(|&e| (0..job.items.len()).filter(|&i| job.items[i].expert == e).collect()).collect();
    let jobs: Vec<(usize, Vec<f32>)> = experts
        .iter()
        .zip(&items)
        .map(|(&e, its)| (e as usize, its.iter().flat_map(|&i| job.rows[job.items[i].row as usize * d..][..d].iter().copied()).collect()))
        .collect();
    let outs = bank.mlp_each(job.layer as usize, &jobs).expect("held experts checked");
    let mut out = vec![0f32; job.items.len() * d];
    for (its, o) in items.iter().zip(outs) {
        for (&i, row) in its.iter().zip(o.chunks_exact(d)) {
            out[i * d..(i + 1) * d].copy_from_slice(&scaled(row, job.items[i].weight));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_parse() {
        assert_eq!("1/2".parse(), Ok(ExpertShare { index: 1, of: 2 }));
        for bad in ["2/2", "0/0", "1", "a/b", "-1/2"] {
            assert!(bad.parse::<ExpertShare>().is_err(), "{bad}");
        }
    }
}
