//! Sessions whose KV was lost with a worker, remembered (the most recent ones, bounded) so
//! that a client continuing one hears why it is gone instead of "unknown session".

use std::collections::{HashMap, VecDeque};

use crate::error::GatewayError;

/// How many lost sessions are remembered; older ones read as unknown again.
const REMEMBERED: usize = 4096;

#[derive(Default)]
pub struct LostSessions {
    why: HashMap<String, String>,
    order: VecDeque<String>,
}

impl LostSessions {
    /// Remembers that session `id` was dropped because of `reason`.
    pub fn record(&mut self, id: String, reason: &str) {
        if self.why.insert(id.clone(), reason.to_string()).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > REMEMBERED {
            if let Some(old) = self.order.pop_front() {
                self.why.remove(&old);
            }
        }
    }

    /// The error for a session id the scheduler does not hold: lost (with its reason) if
    /// it was dropped with a worker, else unknown.
    pub fn missing(&self, id: &str) -> GatewayError {
        match self.why.get(id) {
            Some(reason) => GatewayError::SessionLost { session: id.to_string(), reason: reason.clone() },
            None => GatewayError::UnknownSession(id.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_session_says_why_and_the_oldest_are_forgotten() {
        let mut lost = LostSessions::default();
        lost.record("a".into(), "cpu-worker 0 failed (killed)");
        match lost.missing("a") {
            GatewayError::SessionLost { session, reason } => assert_eq!((session.as_str(), reason.as_str()), ("a", "cpu-worker 0 failed (killed)")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(lost.missing("b"), GatewayError::UnknownSession(_)));
        for i in 0..REMEMBERED {
            lost.record(format!("s{i}"), "gone");
        }
        assert!(matches!(lost.missing("a"), GatewayError::UnknownSession(_)), "the oldest is forgotten");
        assert!(matches!(lost.missing(&format!("s{}", REMEMBERED - 1)), GatewayError::SessionLost { .. }));
    }
}
