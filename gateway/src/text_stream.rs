//! Streaming detokenisation with stop strings: text is released as tokens complete it,
//! except a tail that could be the start of a stop string, which is held back until it is
//! known not to be one; at a stop string the text ends just before it. Each stop string is
//! followed a byte at a time (Knuth–Morris–Pratt): a token's cost grows with its bytes and the
//! number of stop strings, not with their length or the held tail's (searching the held tail
//! for every prefix of every stop string at each token made a long stop string cubic).

use duet_model::tokenizer::StreamDecoder;

/// One generation's text stream.
#[derive(Debug, Default)]
pub struct TextStream {
    decoder: StreamDecoder,
    stops: Vec<StopMatcher>,
    held: String,
    stopped: bool,
}

impl TextStream {
    /// Empty stop strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        TextStream { stops: stops.into_iter().filter(|s| !s.is_empty()).map(StopMatcher::new).collect(), ..Default::default() }
    }

    /// Whether a stop string was seen (nothing more is released).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds a token's bytes; returns the text now safe to release.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        if self.stopped {
            return String::new();
        }
        let text = self.decoder.push(bytes);
        self.release(&text)
    }

    /// The end of the generation: whatever is held (flushed from the decoder too), cut at a
    /// stop string if one completes.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let tail = self.decoder.finish();
        let out = self.release(&tail);
        if self.stopped {
            return out;
        }
        out + &std::mem::take(&mut self.held)
    }

    /// Holds `text` after what is held; returns what is now known to begin no stop string.
    fn release(&mut self, text: &str) -> String {
        self.held.push_str(text);
        let mut completed = false;
        for &b in text.as_bytes() {
            for m in &mut self.stops {
                completed |= m.push(b);
            }
            if completed {
                break;
            }
        }
        if completed {
            // The stop string that starts first (one that completes later in this text may).
            let cut = self.stops.iter().filter_map(|m| self.held.find(m.stop.as_str())).min().expect("one completed");
            self.stopped = true;
            let out = self.held[..cut].to_string();
            self.held.clear();
            return out;
        }
        // Hold back the longest tail that some stop string starts with. It starts at a
        // character: a byte that begins a stop string is no UTF-8 continuation byte.
        let keep = self.stops.iter().map(|m| m.matched).max().unwrap_or(0);
        let rest = self.held.split_off(self.held.len() - keep);
        std::mem::replace(&mut self.held, rest)
    }
}

/// A stop string and the longest prefix of it that the text so far ends with.
#[derive(Debug)]
struct StopMatcher {
    stop: String,
    /// `fail[i]`: the length of the longest proper prefix of `stop[..=i]` that is also a
    /// suffix of it (where to fall back to when the next byte does not continue a match).
    fail: Vec<usize>,
    matched: usize,
}

impl StopMatcher {
    fn new(stop: String) -> Self {
        let s = stop.as_bytes();
        let mut fail = vec![0; s.len()];
        let mut k = 0;
        for i in 1..s.len() {
            while k > 0 && s[i] != s[k] {
                k = fail[k - 1];
            }
            if s[i] == s[k] {
                k += 1;
            }
            fail[i] = k;
        }
        StopMatcher { stop, fail, matched: 0 }
    }

    /// Follows one more byte of text; whether the text now ends with the whole stop string.
    fn push(&mut self, b: u8) -> bool {
        let s = self.stop.as_bytes();
        if self.matched == s.len() {
            self.matched = self.fail[self.matched - 1];
        }
        while self.matched > 0 && s[self.matched] != b {
            self.matched = self.fail[self.matched - 1];
        }
        if s[self.matched] == b {
            self.matched += 1;
        }
        self.matched == s.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, String, bool) {
        let mut s = TextStream::new(stops.iter().map(|s| s.to_string()).collect());
        let out: Vec<String> = pieces.iter().map(|p| s.push(p.as_bytes())).collect();
        let tail = s.finish();
        (out, tail, s.stopped())
    }

    #[test]
    fn text_without_stops_flows_through() {
        assert_eq!(run(&[], &["Hel", "lo"]), (vec!["Hel".into(), "lo".into()], String::new(), false));
    }

    #[test]
    fn a_stop_string_across_tokens_cuts_the_text() {
        let (out, tail, stopped) = run(&["END"], &["abc E", "N", "D more"]);
        assert_eq!(out, vec!["abc ".to_string(), String::new(), String::new()]);
        assert_eq!((tail.as_str(), stopped), ("", true));
    }

    #[test]
    fn a_false_start_is_released_later() {
        let (out, tail, stopped) = run(&["END"], &["x E", "NOUGH"]);
        assert_eq!(out, vec!["x ".to_string(), "ENOUGH".to_string()]);
        assert_eq!((tail.as_str(), stopped), ("", false));
        // Held at the very end: released by finish.
        let (out, tail, _) = run(&["END"], &["x EN"]);
        assert_eq!((out[0].as_str(), tail.as_str()), ("x ", "EN"));
    }

    /// The twin: what the stream releases, found by searching the whole held text for every
    /// stop string and every prefix of one at each step.
    fn by_search(stops: &[&str], pieces: &[&str]) -> (Vec<String>, String, bool) {
        let mut held = String::new();
        let mut out = Vec::new();
        for p in pieces {
            held.push_str(p);
            if let Some(cut) = stops.iter().filter_map(|s| held.find(s)).min() {
                out.push(held[..cut].to_string());
                out.extend(std::iter::repeat_n(String::new(), pieces.len() - out.len()));
                return (out, String::new(), true);
            }
            let keep = stops
                .iter()
                .flat_map(|s| (1..s.len().min(held.len() + 1)).filter(|&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
                .filter(|prefix| held.ends_with(prefix))
                .map(str::len)
                .max()
                .unwrap_or(0);
            let rest = held.split_off(held.len() - keep);
            out.push(std::mem::replace(&mut held, rest));
        }
        (out, held, false)
    }

    #[test]
    fn stop_strings_are_found_as_a_search_of_the_whole_text_finds_them() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        // A small alphabet (multibyte letters among them) makes partial matches and
        // overlapping, self-similar stop strings common.
        let letters = ["a", "b", "é", "ab"];
        let word = |rng: &mut rand::rngs::StdRng, n: usize| (0..n).map(|_| letters[rng.random_range(0..letters.len())]).collect::<String>();
        for _ in 0..3000 {
            let stops: Vec<String> = (0..rng.random_range(1..4)).map(|_| { let n = rng.random_range(1..7); word(&mut rng, n) }).collect();
            let pieces: Vec<String> = (0..rng.random_range(1..12)).map(|_| { let n = rng.random_range(0..4); word(&mut rng, n) }).collect();
            let stops: Vec<&str> = stops.iter().map(String::as_str).collect();
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(run(&stops, &pieces), by_search(&stops, &pieces), "stops {stops:?}, pieces {pieces:?}");
        }
    }

    #[test]
    fn a_long_stop_string_the_text_keeps_almost_matching_is_held_whole() {
        // 64 spaces a token against a stop string of 4 000 spaces and an x: the text is held
        // until the stop string cannot begin there, then released whole.
        let stop = " ".repeat(4000) + "x";
        let mut s = TextStream::new(vec![stop]);
        let released: usize = (0..200).map(|_| s.push(" ".repeat(64).as_bytes()).len()).sum();
        assert_eq!(released, 200 * 64 - 4000);
        assert_eq!(s.push(b"y"), " ".repeat(4000) + "y");
        assert!(!s.stopped());
    }

    #[test]
    fn the_earliest_stop_wins_and_multibyte_text_is_safe() {
        let (out, _, stopped) = run(&["é!", "b"], &["aé", "!b"]);
        assert_eq!(out.concat(), "a");
        assert!(stopped);
        let (out, tail, _) = run(&["éé"], &["xé", "y"]);
        assert_eq!(out.concat() + &tail, "xéy");
    }
}
