//! The executor driven with step requests directly (an arena and an exchange ring made here,
//! all attention on the gpu-worker): steps that feed a sequence its own last sample compute
//! what steps carrying the token compute; a step sent after a failed one skips the sequences
//! the failure took and serves the ones that joined it; a step whose new rows of two places
//! land in one block is refused; a synthetic prefill (benchmarks) computes only each chunk's
//! last token and makes up the others' K/V; a sequence taken up from another's KV samples,
//! seeded, what that one did; a sequence whose grammar allows no token fails alone.

use std::sync::Arc;

use duet_model::gguf::GgufFile;
use duet_model::grammar::Grammars;
use duet_model::tokenizer::Tokenizer;
use duet_proto::pb;
use duet_kv::shm::{Ring, Segment};
use duet_kv::{BlockId, KvDtype};
use duet_gpu_worker::worker::arenas::SYNTHETIC_ROWS;
use duet_model::testutil::model_path;
use duet_gpu_worker::device::cpu::CpuDevice;
use duet_gpu_worker::device::Device;
use duet_gpu_worker::worker::executor::Executor;

mod support;

/// An executor with one attached arena of 64 blocks of 16 positions (segments named after
/// this process, removed when the returned guards drop).
fn executor() -> (Executor, (Segment, Ring)) {
    support::executor_with_arena(CpuDevice::load(Arc::new(GgufFile::open(model_path()).unwrap()), true).unwrap(), "exec")
}

fn greedy() -> pb::SamplerConfig {
    pb::SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, seed: 0, top_logprobs: 1, constraint: None, ..Default::default() }
}

/// A sequence's part of a step: `tokens` at `start` (none: fed its last sample).
fn part(seq_id: u64, start: u32, tokens: &[u32], new_blocks: &[u32], first: bool) -> pb::SequenceStep {
    pb::SequenceStep {
        seq_id,
        start_pos: start,
        tokens: tokens.to_vec(),
        new_blocks: new_blocks.iter().map(|&block| pb::KvBlockRef { worker: 0, block }).collect(),
        sampler: first.then(greedy),
        sample: true,
        attention: Vec::new(),
        sub_batch: 0,
        feed_sampled: tokens.is_empty(),
        held_tokens: Vec::new(),
        ..Default::default()
    }
}

fn step(ex: &mut Executor, step: u64, after_step: u64, sequences: Vec<pb::SequenceStep>) -> Result<Vec<(u64, u32, f32)>, String> {
    let req = pb::StepRequest { step, sequences, released: Vec::new(), after_step };
    let resp = ex.step(&req).map_err(|e| e.to_string())?;
    Ok(resp.sampled.iter().map(|s| (s.seq_id, s.token.as_ref().unwrap().id, s.token.as_ref().unwrap().logprob)).collect())
}

const PROMPT: [u32; 5] = [504, 3575, 282, 4649, 314];

#[test]
fn fed_steps_equal_carried_ones_and_a_failed_step_takes_only_its_own_sequences() {
    let (mut ex, _segments) = executor();
    // Sequence 1: every step carries the token sampled before (as before pipelining).
    let mut carried = vec![step(&mut ex, 1, 0, vec![part(1, 0, &PROMPT, &[0], true)]).unwrap()[0]];
    for i in 0..6 {
        let last = carried.last().unwrap().1;
        carried.push(step(&mut ex, 2 + i, 1 + i, vec![part(1, PROMPT.len() as u32 + i as u32, &[last], &[], false)]).unwrap()[0]);
    }
    // Sequence 2: the same prompt, then steps that feed it its own last sample.
    let mut fed = vec![step(&mut ex, 10, 0, vec![part(2, 0, &PROMPT, &[1], true)]).unwrap()[0]];
    for i in 0..6 {
        fed.push(step(&mut ex, 11 + i, 10 + i, vec![part(2, PROMPT.len() as u32 + i as u32, &[], &[], false)]).unwrap()[0]);
    }
    let strip = |v: &[(u64, u32, f32)]| v.iter().map(|&(_, t, l)| (t, l.to_bits())).collect::<Vec<_>>();
    assert_eq!(strip(&fed), strip(&carried), "fed steps sample what carried ones do, bit for bit");

    // A step that fails (sequence 4 has no input) takes sequence 2 with it.
    let at = PROMPT.len() as u32 + 6;
    let bad = pb::SequenceStep { feed_sampled: false, ..part(4, 0, &[], &[2], true) };
    assert!(step(&mut ex, 20, 16, vec![part(2, at, &[], &[], false), bad]).is_err());
    // The step sent after it: sequence 2 is skipped, sequence 3 (joining) is served.
    let next = step(&mut ex, 21, 20, vec![part(2, at + 1, &[], &[], false), part(3, 0, &PROMPT, &[3], true)]).unwrap();
    assert_eq!(next.iter().map(|s| (s.0, s.1)).collect::<Vec<_>>(), vec![(3, carried[0].1)], "only the joining sequence samples");
    // Not sent after another step: an unknown sequence is an error, as it always was.
    let err = step(&mut ex, 22, 0, vec![part(2, at + 1, &[], &[], false)]).unwrap_err();
    assert!(err.contains("unknown"), "{err}");
}

#[test]
fn a_sequence_whose_grammar_allows_no_token_fails_alone() {
    let gguf = Arc::new(GgufFile::open(model_path()).unwrap());
    let grammars = Grammars::new(&Tokenizer::from_gguf(&gguf).unwrap()).unwrap();
    let (ex, _segments) = support::executor_with_arena(CpuDevice::load(gguf, true).unwrap(), "exec-grammar");
    let mut ex = ex.with_grammars(grammars);
    // A regular expression that compiles but matches no text (the gateway refuses it; here
    // it stands for a grammar that leaves no token allowed).
    let nothing = pb::SamplerConfig { constraint: Some(pb::OutputConstraint { kind: Some(pb::output_constraint::Kind::Regex("[a&&b]".into())) }), ..greedy() };
    let stuck = pb::SequenceStep { sampler: Some(nothing), ..part(1, 0, &PROMPT, &[0], true) };
    let req = pb::StepRequest { step: 1, sequences: vec![stuck, part(2, 0, &PROMPT, &[1], true)], released: Vec::new(), after_step: 0 };
    let resp = ex.step(&req).expect("the step goes on for the other sequence");
    assert_eq!(resp.sampled.iter().map(|s| s.seq_id).collect::<Vec<_>>(), vec![2]);
    assert_eq!(resp.failed.len(), 1);
    assert_eq!(resp.failed[0].seq_id, 1);
    assert!(resp.failed[0].reason.contains("allows no token") && !resp.failed[0].reason.contains('\n'), "{}", resp.failed[0].reason);
    // Forgotten: the step pipelined after it skips it and serves the other.
    let at = PROMPT.len() as u32;
    let next = step(&mut ex, 2, 1, vec![part(1, at, &[], &[], false), part(2, at, &[], &[], false)]).unwrap();
    assert_eq!(next.iter().map(|s| s.0).collect::<Vec<_>>(), vec![2]);
}

/// Two sequences whose new rows land in one block would write one slot from two rows (and the
/// rows are written in parallel): the step is refused, naming the block, and nothing runs.
#[test]
fn a_block_given_to_two_sequences_is_refused() {
    let (mut ex, _segments) = support::executor_with_arena(CpuDevice::load(Arc::new(GgufFile::open(model_path()).unwrap()), true).unwrap(), "exec-shared");
    let err = step(&mut ex, 1, 0, vec![part(1, 0, &PROMPT, &[3], true), part(2, 0, &PROMPT, &[3], true)]).unwrap_err();
    assert!(err.contains("block 3 of cpu-worker 0 takes new rows of two sequences"), "{err}");
    // The block given twice in one sequence's list, where both places take new rows.
    let long: Vec<u32> = PROMPT.iter().cycle().take(20).copied().collect();
    let err = step(&mut ex, 2, 0, vec![part(3, 0, &long, &[5, 5], true)]).unwrap_err();
    assert!(err.contains("block 5 of cpu-worker 0"), "{err}");
    // Distinct blocks: served.
    assert_eq!(step(&mut ex, 3, 0, vec![part(4, 0, &PROMPT, &[6], true), part(5, 0, &PROMPT, &[7], true)]).unwrap().len(), 2);
}

/// Two executors on the same model, one with `--synthetic-prefill`, each with its arena, and
/// a 40-token prompt.
struct Pair {
    real: Executor,
    real_arena: (Segment, Ring),
    synth: Executor,
    synth_arena: (Segment, Ring),
    layout: duet_kv::ArenaLayout,
    prompt: Vec<u32>,
}

fn pair(tag: &str) -> Pair {
    let load = || CpuDevice::load(Arc::new(GgufFile::open(model_path()).unwrap()), true).unwrap();
    let (real, real_arena) = support::executor_with_arena(load(), &format!("exec-real{tag}"));
    let (ex, synth_arena) = support::executor_with_arena(load(), &format!("exec-synth{tag}"));
    let synth = ex.with_synthetic_prefill();
    let layout = support::arena_layout(synth.device().config(), KvDtype::F16);
    Pair { real, real_arena, synth, synth_arena, layout, prompt: PROMPT.iter().cycle().take(40).copied().collect() }
}

/// `--synthetic-prefill`: a 40-token prompt writes made-up rows at positions 0..39 of every
/// layer (cycling through `SYNTHETIC_ROWS` rows) and computes position 39 itself, whose
/// layer-0 K/V (which depend only on its token and position) are what a real prefill stores;
/// the prompt counts as prefilled, and decode goes on from it.
#[test]
fn a_synthetic_prefill_makes_up_all_but_the_last_tokens_kv() {
    let Pair { mut real, real_arena, mut synth, synth_arena, layout, prompt } = pair("1");
    let req = |ex: &mut Executor| {
        let req = pb::StepRequest { step: 1, sequences: vec![part(1, 0, &prompt, &[0, 1, 2], true)], released: Vec::new(), after_step: 0 };
        ex.step(&req).unwrap()
    };
    req(&mut real);
    let synth_resp = req(&mut synth);
    assert_eq!(synth_resp.timings.as_ref().map(|t| (t.prefill_tokens, t.decode_tokens)), Some((40, 0)));
    assert_eq!(synth_resp.sampled.len(), 1);
    let row = |arena: &Segment, kv: usize, layer: u32, head: u32, pos: usize| -> Vec<u16> {
        let block = BlockId((pos / 16) as u32);
        let offset = if kv == 0 { layout.k_offset(block, layer, head) } else { layout.v_offset(block, layer, head) };
        let n = layout.head_dim as usize;
        // SAFETY: inside the arena; no step runs while the test reads it.
        unsafe { arena.slice::<u16>(offset + (pos % 16) * layout.row_bytes().unwrap(), n) }.to_vec()
    };
    for layer in 0..layout.n_layer {
        for head in 0..layout.n_kv_head {
            for kv in 0..2 {
                for pos in 0..39 {
                    let made_up = row(&synth_arena.0, kv, layer, head, pos);
                    assert_ne!(made_up, row(&real_arena.0, kv, layer, head, pos), "layer {layer} position {pos} was computed");
                    assert_ne!(made_up, row(&synth_arena.0, kv, layer, head, pos + 1), "layer {layer} position {pos} left unwritten");
                    if pos + SYNTHETIC_ROWS < 39 {
                        assert_eq!(made_up, row(&synth_arena.0, kv, layer, head, pos + SYNTHETIC_ROWS), "layer {layer} position {pos}");
                    }
                }
            }
        }
    }
    // The last token computed at its position: layer 0's rows as a real prefill's, to the
    // rounding of a one-row product against a 40-row one.
    for head in 0..layout.n_kv_head {
        for kv in 0..2 {
            let (a, b) = (row(&real_arena.0, kv, 0, head, 39), row(&synth_arena.0, kv, 0, head, 39));
            for (x, y) in a.iter().zip(&b) {
                let (x, y) = (half::f16::from_bits(*x).to_f32(), half::f16::from_bits(*y).to_f32());
                assert!((x - y).abs() <= 1e-2 * x.abs().max(1.0), "head {head} {kv}: {x} vs {y}");
            }
        }
    }
    // Layer 1's are computed from attention over the context: the made-up one, not the real.
    assert_ne!(row(&real_arena.0, 0, 1, 0, 39), row(&synth_arena.0, 0, 1, 0, 39), "the last token did not attend the made-up context");
    // Decode goes on from the made-up context.
    let next = step(&mut synth, 2, 1, vec![part(1, 40, &[], &[], false)]).unwrap();
    assert_eq!(next.len(), 1);
    assert!(next[0].2.is_finite());
}

/// A synthetic prefill beside a decode in one step: the prompt's rows shrink to one, and the
/// decoding sequence behind it in the batch still samples what it samples beside a real
/// prefill (bit for bit); a prompt in two chunks has each chunk's last token computed.
#[test]
fn a_synthetic_prefill_leaves_the_other_rows_of_its_step_alone() {
    let Pair { mut real, real_arena, mut synth, synth_arena, layout, prompt } = pair("2");
    // Sequence 1 decodes from a one-token prompt (nothing made up): the same KV in both.
    let mut outs: Vec<Vec<(u64, u32, f32)>> = Vec::new();
    for ex in [&mut real, &mut synth] {
        step(ex, 1, 0, vec![part(1, 0, &PROMPT[..1], &[0], true)]).unwrap();
        for i in 0..3 {
            step(ex, 2 + i, 1 + i, vec![part(1, 1 + i as u32, &[], &[], false)]).unwrap();
        }
        // The prompt first in the batch, the decode row behind it.
        outs.push(step(ex, 5, 4, vec![part(2, 0, &prompt, &[4, 5, 6], true), part(1, 4, &[], &[], false)]).unwrap());
    }
    let of = |v: &[(u64, u32, f32)], id: u64| v.iter().find(|s| s.0 == id).map(|s| (s.1, s.2.to_bits()));
    assert_eq!(of(&outs[1], 1), of(&outs[0], 1), "the decode row beside a synthetic prefill");
    assert!(of(&outs[1], 2).is_some());
    // A prompt in two chunks (24 tokens, then 16): positions 23 and 39 computed.
    let chunk = |start: usize, n: usize, blocks: &[u32], sample: bool| pb::SequenceStep {
        sample,
        ..part(3, start as u32, &prompt[start..start + n], blocks, start == 0)
    };
    for ex in [&mut real, &mut synth] {
        step(ex, 6, 0, vec![chunk(0, 24, &[8, 9], false)]).unwrap();
        step(ex, 7, 0, vec![chunk(24, 16, &[10], true)]).unwrap();
    }
    let k0 = |arena: &Segment, pos: usize| -> Vec<f32> {
        let block = BlockId(8 + (pos / 16) as u32);
        // SAFETY: inside the arena; no step runs while the test reads it.
        let h = unsafe { arena.slice::<u16>(layout.k_offset(block, 0, 0) + (pos % 16) * layout.row_bytes().unwrap(), layout.head_dim as usize) };
        h.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect()
    };
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-2 * x.abs().max(1.0));
    for pos in [23, 39] {
        assert!(close(&k0(&real_arena.0, pos), &k0(&synth_arena.0, pos)), "position {pos} of the chunked prompt was not computed");
    }
    for pos in [22, 24, 38] {
        assert!(!close(&k0(&real_arena.0, pos), &k0(&synth_arena.0, pos)), "position {pos} of the chunked prompt was computed");
    }
}

/// A sequence taken up from KV it did not compute — another sequence's whole block, as the
/// gateway's prefix cache hands it over, or its own after a worker failed — samples, seeded
/// at a temperature, what the sequence that computed it samples from there: the draw at a
/// position depends on the seed and the position, not on the sampler's past.
#[test]
fn a_sequence_taken_up_from_shared_kv_samples_what_the_first_did() {
    let (mut ex, _segments) = support::executor_with_arena(CpuDevice::load(Arc::new(GgufFile::open(model_path()).unwrap()), true).unwrap(), "exec-taken-up");
    let seeded = pb::SamplerConfig { temperature: 1.2, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, seed: 11, top_logprobs: 1, ..Default::default() };
    let prompt: Vec<u32> = PROMPT.iter().cycle().take(16).copied().collect();
    // Sequence 1: the 16-token prompt fills block 0; 8 tokens follow in block 1.
    let mut first = vec![step(&mut ex, 1, 0, vec![pb::SequenceStep { sampler: Some(seeded.clone()), ..part(1, 0, &prompt, &[0], false) }]).unwrap()[0]];
    for i in 0..7 {
        let new_block: &[u32] = if i == 0 { &[1] } else { &[] };
        first.push(step(&mut ex, 2 + i, 1 + i, vec![part(1, 16 + i as u32, &[], new_block, false)]).unwrap()[0]);
    }
    // Sequence 2 starts from block 0 (held: the prompt) with its own block 2, fed the first
    // sequence's first token: from there it samples the same tokens, bit for bit.
    let taken_up = pb::SequenceStep { sampler: Some(seeded), held_tokens: prompt.clone(), ..part(2, 16, &[first[0].1], &[0, 2], false) };
    let mut second = vec![step(&mut ex, 20, 0, vec![taken_up]).unwrap()[0]];
    for i in 0..5 {
        second.push(step(&mut ex, 21 + i, 20 + i, vec![part(2, 17 + i as u32, &[], &[], false)]).unwrap()[0]);
    }
    let strip = |v: &[(u64, u32, f32)]| v.iter().map(|&(_, t, l)| (t, l.to_bits())).collect::<Vec<_>>();
    assert_eq!(strip(&second), strip(&first[1..7]));
    assert!(first.iter().any(|t| t.1 != first[0].1), "the draws vary: {first:?}");
}
