//! Hot experts on the device (`--device-experts K`, with the experts on the cpu-workers): the
//! plan of which routed experts the gpu-worker's device computes itself, changed at run time
//! from the router's statistics, as KTransformers keeps a mixture's most-used experts on the
//! GPU. Every `every` steps the `k` experts of each layer with the most routed tokens (counts
//! halved at each plan, so recent traffic weighs most; never-used experts are not taken) are
//! held on the device and the rest left to the cpu-workers, which serve their whole share
//! either way; only the experts that enter or leave the plan move.

use duet_proto::pb;

/// The running plan: decayed routed-token counts per (layer, expert).
#[derive(Debug)]
pub struct HotExperts {
    k: usize,
    every: u64,
    n_expert: usize,
    heat: Vec<f64>,
    steps: u64,
}

impl HotExperts {
    /// Up to `k` experts per layer of `n_layer` layers of `n_expert`, planned every `every` steps.
    pub fn new(k: usize, every: u64, n_layer: usize, n_expert: usize) -> Self {
        HotExperts { k: k.min(n_expert), every: every.max(1), n_expert, heat: vec![0.0; n_layer * n_expert], steps: 0 }
    }

    /// Adds a step's routed-token counts; returns the new plan (`[layer]` → experts, ascending)
    /// when this step is one at which to plan.
    pub fn step(&mut self, routed: &[pb::ExpertRouted]) -> Option<Vec<Vec<usize>>> {
        for r in routed {
            if let Some(h) = self.heat.get_mut(r.layer as usize * self.n_expert + r.expert as usize).filter(|_| (r.expert as usize) < self.n_expert) {
                *h += f64::from(r.tokens);
            }
        }
        self.steps += 1;
        if !self.steps.is_multiple_of(self.every) {
            return None;
        }
        let plan = self
            .heat
            .chunks(self.n_expert.max(1))
            .map(|layer| {
                let mut order: Vec<usize> = (0..layer.len()).filter(|&e| layer[e] > 0.0).collect();
                // The hottest first; ties to the lower index, so a plan is a function of the counts.
                order.sort_by(|&a, &b| layer[b].total_cmp(&layer[a]).then(a.cmp(&b)));
                order.truncate(self.k);
                order.sort_unstable();
                order
            })
            .collect();
        self.heat.iter_mut().for_each(|h| *h *= 0.5);
        Some(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(layer: u32, expert: u32, tokens: u32) -> pb::ExpertRouted {
        pb::ExpertRouted { layer, expert, tokens }
    }

    #[test]
    fn plans_the_hottest_experts_of_each_layer_every_few_steps() {
        let mut h = HotExperts::new(2, 2, 2, 4);
        assert_eq!(h.step(&[routed(0, 3, 5), routed(0, 1, 2), routed(0, 2, 1), routed(1, 0, 4)]), None, "not yet");
        let plan = h.step(&[routed(0, 2, 1), routed(9, 0, 1), routed(0, 7, 9)]).expect("a plan every 2 steps");
        assert_eq!(plan, vec![vec![1, 3], vec![0]], "layer 0: 3 (5) and 1 (2) over 2 (2, the higher index); layer 1: only the used one");
        // Recent traffic wins once the old counts have been halved.
        h.step(&[routed(1, 2, 3), routed(1, 1, 3)]);
        let plan = h.step(&[]).unwrap();
        assert_eq!(plan[1], vec![1, 2], "3 + 3 now beats 4 / 2");
        assert_eq!(HotExperts::new(9, 1, 1, 3).step(&[routed(0, 0, 1), routed(0, 1, 1), routed(0, 2, 1)]).unwrap(), vec![vec![0, 1, 2]], "k capped at the experts");
    }
}
