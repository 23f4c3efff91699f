//! Reads every tensor of the memory-mapped model once at load, so that the weights are in
//! memory before the first request (a cold multi-gigabyte file otherwise makes the first
//! steps crawl at disk speed). Shows a progress bar when stderr is a terminal, and log lines
//! at every quarter otherwise.

use std::io::IsTerminal;
use std::time::Instant;

use duet_model::gguf::GgufFile;
use indicatif::{ProgressBar, ProgressStyle};

/// Bytes between two reads: one per page is enough to fault every page in.
const PAGE: usize = 4096;

/// Where the progress goes.
enum Progress {
    Bar(ProgressBar),
    Log { next_quarter: u64 },
}

/// Touches every page of every tensor but those `skip` names (weights computed elsewhere);
/// returns the bytes read.
pub fn page_in_weights(file: &GgufFile, skip: impl Fn(&str) -> bool) -> u64 {
    let total: u64 = file.tensors.iter().filter(|t| !skip(&t.name)).map(|t| t.size_bytes).sum();
    let mut progress = if std::io::stderr().is_terminal() {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template("loading weights {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Progress::Bar(bar)
    } else {
        Progress::Log { next_quarter: 1 }
    };
    let started = Instant::now();
    let mut done = 0u64;
    let mut checksum = 0u8;
    for info in file.tensors.iter().filter(|t| !skip(&t.name)) {
        let Ok(view) = file.tensor(&info.name) else { continue };
        checksum = view.data.iter().step_by(PAGE).fold(checksum, |acc, &b| acc ^ b);
        done += info.size_bytes;
        match &mut progress {
            Progress::Bar(bar) => bar.set_position(done),
            Progress::Log { next_quarter } => {
                while *next_quarter <= 4 && done * 4 >= total * *next_quarter {
                    tracing::info!("loading weights: {}% ({} of {} MiB)", *next_quarter * 25, done >> 20, total >> 20);
                    *next_quarter += 1;
                }
            }
        }
    }
    std::hint::black_box(checksum);
    if let Progress::Bar(bar) = progress {
        bar.finish_and_clear();
    }
    tracing::info!("weights in memory: {} MiB in {:.2} s", total >> 20, started.elapsed().as_secs_f64());
    done
}
