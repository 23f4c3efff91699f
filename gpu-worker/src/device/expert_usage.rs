//! How often a mixture's router chose each expert of each layer: the runtime statistics an
//! expert placement is planned from (which experts are hot, per layer). The device counts as
//! it routes; the executor takes the counts of each step into its `StepTimings`, from which
//! the gateway keeps the totals (`duet_expert_routed_tokens_total`).

use std::sync::atomic::{AtomicU32, Ordering};

/// Routed tokens per (layer, expert) since the last [`ExpertUsage::take`].
#[derive(Debug)]
pub struct ExpertUsage {
    n_expert: usize,
    counts: Vec<AtomicU32>,
}

/// One (layer, expert) count taken from [`ExpertUsage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutedTokens {
    pub layer: u32,
    pub expert: u32,
    pub tokens: u32,
}

impl ExpertUsage {
    pub fn new(n_layer: usize, n_expert: usize) -> Self {
        ExpertUsage { n_expert, counts: (0..n_layer * n_expert).map(|_| AtomicU32::new(0)).collect() }
    }

    /// Counts layer `layer`'s choices: `routes[row]` lists the experts chosen for a row.
    pub fn record<'a>(&self, layer: usize, routes: impl IntoIterator<Item = &'a [(usize, f32)]>) {
        for route in routes {
            for &(expert, _) in route {
                if let Some(c) = self.counts.get(layer * self.n_expert + expert) {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// The non-zero counts, layer by layer and expert by expert, each reset to zero.
    pub fn take(&self) -> Vec<RoutedTokens> {
        let n = self.n_expert.max(1);
        self.counts
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match c.swap(0, Ordering::Relaxed) {
                0 => None,
                tokens => Some(RoutedTokens { layer: (i / n) as u32, expert: (i % n) as u32, tokens }),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_choice_once_and_take_resets() {
        let u = ExpertUsage::new(2, 4);
        let routes: Vec<Vec<(usize, f32)>> = vec![vec![(3, 0.7), (0, 0.3)], vec![(3, 0.6), (1, 0.4)]];
        u.record(1, routes.iter().map(Vec::as_slice));
        u.record(0, [&[(2usize, 1.0f32)][..]]);
        let want = [(0, 2, 1), (1, 0, 1), (1, 1, 1), (1, 3, 2)].map(|(layer, expert, tokens)| RoutedTokens { layer, expert, tokens });
        assert_eq!(u.take(), want);
        assert!(u.take().is_empty(), "taken counts start again from zero");
        u.record(5, [&[(0usize, 1.0f32)][..]]);
        assert!(u.take().is_empty(), "a layer out of range counts nothing");
    }
}
