//! The balancer: where each step's decode attention runs. A policy (`lp`, the default, or
//! a static `cpu`, `gpu`, `ratio:R`) turns the step's decode sequences and the cost model
//! fitted from runtime statistics ([`stats`], its fits [`fit`]) into per-sequence shares ([`planner`]).

pub mod fit;
pub mod planner;
pub mod stats;

use std::fmt;
use std::str::FromStr;

use planner::{plan_lp, realise, solve, CostModel, Plan, SeqDemand};

/// How decode attention is split between the gpu-worker and the cpu-workers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// The split that minimises the predicted step time (linear program over measured costs).
    Lp,
    /// All on the cpu-workers that hold the KV.
    Cpu,
    /// All on the gpu-worker.
    Gpu,
    /// This fraction of each context (its first positions) on the gpu-worker, the rest on
    /// the cpu-workers.
    Ratio(f32),
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lp" => Ok(Policy::Lp),
            "cpu" => Ok(Policy::Cpu),
            "gpu" => Ok(Policy::Gpu),
            _ => match s.strip_prefix("ratio:").map(str::parse::<f32>) {
                Some(Ok(r)) if (0.0..=1.0).contains(&r) => Ok(Policy::Ratio(r)),
                _ => Err(format!("balancer policy {s:?}: expected lp, cpu, gpu or ratio:R with R in [0, 1]")),
            },
        }
    }
}

/// Whether decode steps may run as two interleaved sub-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    /// When the `lp` planner predicts it is faster (static policies never overlap).
    Auto,
    /// Every decode-only step of two or more sequences, whatever the policy.
    Always,
    /// Never.
    Never,
}

impl FromStr for Overlap {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Overlap::Auto),
            "always" => Ok(Overlap::Always),
            "never" => Ok(Overlap::Never),
            _ => Err(format!("overlap {s:?}: expected auto, always or never")),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Lp => f.write_str("lp"),
            Policy::Cpu => f.write_str("cpu"),
            Policy::Gpu => f.write_str("gpu"),
            Policy::Ratio(r) => write!(f, "ratio:{r}"),
        }
    }
}

impl Policy {
    /// Plans a step of `tokens` batch tokens whose decode sequences are `seqs`. A step that
    /// `may_overlap` (decode only) runs as two interleaved sub-batches as `overlap` says:
    /// with `Auto`, when `lp` predicts it faster.
    pub fn plan(&self, cost: &CostModel, tokens: usize, seqs: &[SeqDemand], block_size: usize, may_overlap: bool, overlap: Overlap) -> Plan {
        let forced = may_overlap && seqs.len() >= 2 && overlap == Overlap::Always;
        let lp = || match overlap {
            Overlap::Auto => plan_lp(cost, tokens, seqs, block_size, may_overlap),
            Overlap::Always | Overlap::Never => solve(cost, tokens, seqs, block_size, forced),
        };
        let prefix: Vec<usize> = match *self {
            Policy::Lp => match lp() {
                Ok(plan) => return plan,
                Err(e) => {
                    tracing::warn!("{e}; this step splits half and half");
                    seqs.iter().map(|s| s.n_ctx / 2).collect()
                }
            },
            Policy::Cpu => vec![0; seqs.len()],
            Policy::Gpu => seqs.iter().map(|s| s.gpu_max).collect(),
            Policy::Ratio(r) => seqs.iter().map(|s| ((s.n_ctx as f64 * r as f64).round() as usize).min(s.gpu_max)).collect(),
        };
        realise(cost, tokens, seqs, &prefix, forced)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_modes_parse() {
        assert_eq!("auto".parse(), Ok(Overlap::Auto));
        assert_eq!("always".parse(), Ok(Overlap::Always));
        assert_eq!("never".parse(), Ok(Overlap::Never));
        assert!("sometimes".parse::<Overlap>().is_err());
    }

    #[test]
    fn policies_parse_and_print() {
        for s in ["lp", "cpu", "gpu", "ratio:0.25"] {
            assert_eq!(s.parse::<Policy>().unwrap().to_string(), s);
        }
        assert_eq!("ratio:1".parse(), Ok(Policy::Ratio(1.0)));
        for bad in ["ratio:2", "ratio:-0.1", "ratio:x", "split", ""] {
            assert!(bad.parse::<Policy>().is_err(), "{bad}");
        }
    }

    #[test]
    fn static_policies_split_as_named() {
        let cost = CostModel {
            linear_fixed: 0.0,
            linear_per_token: 0.0,
            gpu_attn_per_pos: 1e-6,
            cpu_fixed: vec![0.0],
            cpu_attn_per_pos: vec![1e-6],
            overlapped_fixed: 0.0,
            overlapped_per_token: 0.0,
            overlap_slowdown: 1.0,
            shared_cores: false,
            local_linear: None,
        };
        let seqs = [SeqDemand { n_ctx: 100, held: vec![(0, 0..100)], gpu_max: 100 }];
        assert_eq!(Policy::Cpu.plan(&cost, 1, &seqs, 16, false, Overlap::Auto).gpu_positions, 0);
        assert_eq!(Policy::Gpu.plan(&cost, 1, &seqs, 16, false, Overlap::Auto).gpu_positions, 100);
        assert_eq!(Policy::Ratio(0.3).plan(&cost, 1, &seqs, 16, false, Overlap::Auto).gpu_positions, 30);
        assert_eq!(Policy::Lp.plan(&cost, 1, &seqs, 16, true, Overlap::Auto).cpu_positions[0] + Policy::Lp.plan(&cost, 1, &seqs, 16, true, Overlap::Auto).gpu_positions, 100);
    }
}
