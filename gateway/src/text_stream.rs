//! Streaming detokenisation with stop strings: text is released as tokens complete it,
//! except a tail that could be the start of a stop string, which is held back until it is
//! known not to be one; at a stop string the text ends just before it.

use duet_model::tokenizer::StreamDecoder;

/// One generation's text stream.
#[derive(Debug, Default)]
pub struct TextStream {
    decoder: StreamDecoder,
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl TextStream {
    /// Empty stop strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        TextStream { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), ..Default::default() }
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
        self.held.push_str(&text);
        self.release()
    }

    /// The end of the generation: whatever is held (flushed from the decoder too), cut at a
    /// stop string if one completes.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let tail = self.decoder.finish();
        self.held.push_str(&tail);
        let out = self.release();
        if self.stopped {
            return out;
        }
        out + &std::mem::take(&mut self.held)
    }

    fn release(&mut self) -> String {
        if let Some(cut) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.stopped = true;
            let out = self.held[..cut].to_string();
            self.held.clear();
            return out;
        }
        // Hold back the longest tail that some stop string starts with.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len().min(self.held.len() + 1)).filter(move |&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
            .filter(|prefix| self.held.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let split = self.held.len() - keep;
        let rest = self.held.split_off(split);
        std::mem::replace(&mut self.held, rest)
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

    #[test]
    fn the_earliest_stop_wins_and_multibyte_text_is_safe() {
        let (out, _, stopped) = run(&["é!", "b"], &["aé", "!b"]);
        assert_eq!(out.concat(), "a");
        assert!(stopped);
        let (out, tail, _) = run(&["éé"], &["xé", "y"]);
        assert_eq!(out.concat() + &tail, "xéy");
    }
}
