//! The one bounded polling helper.
//!
//! A [`Poll`] names what it awaits, how long it may take and how often it checks; a check answers
//! [`Probe::Ready`] (done, with a value), [`Probe::Pending`] (not yet, with the state it saw) or an
//! error (stop now: a process died, a request failed for good). A timeout is an error that names
//! the awaited thing, the timeout and the last state seen, so a failing test says what never
//! happened. The async and the blocking form share that contract and that message.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

/// How often a poll checks again unless [`Poll::every`] says otherwise.
pub const POLL_INTERVAL: Duration = Duration::from_millis(25);

/// What one check of a polled condition found.
#[derive(Debug)]
pub enum Probe<T> {
    /// The condition holds; the poll returns this value.
    Ready(T),
    /// Not yet; the text (the last state seen, may be empty) goes into the timeout message.
    Pending(String),
}

impl From<bool> for Probe<()> {
    fn from(holds: bool) -> Probe<()> {
        match holds {
            true => Probe::Ready(()),
            false => Probe::Pending(String::new()),
        }
    }
}

/// A bounded poll: what it awaits, its timeout and its interval.
#[derive(Clone, Debug)]
pub struct Poll {
    what: String,
    timeout: Duration,
    every: Duration,
}

impl Poll {
    /// A poll for `what` (said in the timeout message) that gives up after `timeout`, checking
    /// every [`POLL_INTERVAL`].
    pub fn new(what: impl Into<String>, timeout: Duration) -> Poll {
        Poll {
            what: what.into(),
            timeout,
            every: POLL_INTERVAL,
        }
    }

    /// Checks every `every` instead.
    pub fn every(mut self, every: Duration) -> Poll {
        self.every = every;
        self
    }

    /// Runs `check` until it is ready (its value), fails (its error, at once) or the deadline
    /// passes (an error naming what was awaited). `check` runs at least once.
    pub async fn until<T>(&self, mut check: impl AsyncFnMut() -> Result<Probe<T>>) -> Result<T> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match check().await? {
                Probe::Ready(v) => return Ok(v),
                Probe::Pending(last) => self.give_up_at(deadline, &last)?,
            }
            tokio::time::sleep(self.every).await;
        }
    }

    /// [`Poll::until`] for code outside an async runtime (it sleeps the thread).
    pub fn until_blocking<T>(&self, mut check: impl FnMut() -> Result<Probe<T>>) -> Result<T> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match check()? {
                Probe::Ready(v) => return Ok(v),
                Probe::Pending(last) => self.give_up_at(deadline, &last)?,
            }
            std::thread::sleep(self.every);
        }
    }

    fn give_up_at(&self, deadline: Instant, last: &str) -> Result<()> {
        if Instant::now() < deadline {
            return Ok(());
        }
        let what = &self.what;
        let timeout = self.timeout;
        match last.is_empty() {
            true => bail!("timed out after {timeout:?} waiting for {what}"),
            false => bail!("timed out after {timeout:?} waiting for {what} (last: {last})"),
        }
    }
}

/// Polls the condition `holds` until it is true: the common case of [`Poll::until`].
pub async fn wait_until(
    what: &str,
    timeout: Duration,
    mut holds: impl AsyncFnMut() -> bool,
) -> Result<()> {
    Poll::new(what, timeout)
        .until(async || Ok(Probe::from(holds().await)))
        .await
}

/// [`wait_until`] outside an async runtime.
pub fn wait_until_blocking(
    what: &str,
    timeout: Duration,
    mut holds: impl FnMut() -> bool,
) -> Result<()> {
    Poll::new(what, timeout).until_blocking(|| Ok(Probe::from(holds())))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_timeout_names_what_was_awaited_and_the_last_state() {
        let poll =
            Poll::new("the answer", Duration::from_millis(30)).every(Duration::from_millis(5));
        let mut n = 0;
        let err = poll
            .until_blocking(|| {
                n += 1;
                Ok(Probe::<()>::Pending(format!("saw {n}")))
            })
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("timed out after 30ms waiting for the answer (last: saw "),
            "{err}"
        );
        assert!(n >= 2, "checked {n} times");
    }

    #[test]
    fn an_error_stops_the_poll_at_once() {
        let mut n = 0;
        let err = Poll::new("x", Duration::from_secs(10))
            .until_blocking(|| -> Result<Probe<()>> {
                n += 1;
                bail!("gone")
            })
            .unwrap_err();
        assert_eq!((err.to_string(), n), ("gone".to_owned(), 1));
    }

    #[tokio::test]
    async fn ready_returns_the_value() {
        let mut n = 0;
        let v = Poll::new("three", Duration::from_secs(10))
            .every(Duration::from_millis(1))
            .until(|| {
                n += 1;
                let n = n;
                async move {
                    Ok(match n {
                        3 => Probe::Ready(n * 10),
                        _ => Probe::Pending(String::new()),
                    })
                }
            })
            .await
            .unwrap();
        assert_eq!(v, 30);
        let err = wait_until("never", Duration::from_millis(10), || async { false })
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "timed out after 10ms waiting for never");
    }
}
