//! Live bytes against active tokens and sequences: the KV cache's bytes per
//! token, the fixed bytes (weights and buffers), and each sequence's
//! activation and workspace overhead. kv_growth and the capacity estimate
//! both read it.

use crate::growth::{thin, MAX_FIT_POINTS};
use crate::stats::{self, Line};
use crate::timeline::{Point, Timeline};

/// Fewer readings inside requests than this make no bytes-per-token claim.
pub const MIN_FIT_POINTS: usize = 3;

/// Mann–Kendall significance for "live bytes rise with tokens". Looser than
/// the leak test: here the tokens are known to grow and the question is
/// whether memory follows them.
pub const FIT_P_VALUE: f64 = 0.01;

#[derive(Clone, Debug, PartialEq)]
pub struct TokenFit {
    pub bytes_per_token: f64,
    /// Live bytes that do not scale with tokens or sequences (weights, buffers).
    pub fixed_bytes: f64,
    /// Live bytes per sequence beyond its KV.
    pub live_per_sequence: f64,
    /// The largest transient seen per sequence: peak − live where the peak
    /// rose since the previous reading (peaks are cumulative otherwise).
    pub transient_per_sequence: f64,
    /// The longest per-sequence context seen.
    pub context_tokens: u64,
    pub max_tokens: u64,
    pub max_sequences: u64,
    pub points: usize,
    /// Relative half-spread (IQR / 2 / median) of the pairwise slopes.
    pub spread: f64,
    pub p_value: f64,
    /// R² of a least-squares line through the same points.
    pub r2: f64,
}

impl TokenFit {
    /// What one more sequence of `context_tokens` costs.
    pub fn per_sequence_bytes(&self) -> f64 {
        self.context_tokens as f64 * self.bytes_per_token + self.overhead_per_sequence()
    }

    pub fn overhead_per_sequence(&self) -> f64 {
        self.live_per_sequence + self.transient_per_sequence
    }
}

/// Sequences in a reading: a runtime that reports tokens but not sequences
/// runs one.
fn sequences(p: &Point) -> u64 {
    p.active_sequences.max(1)
}

/// Fits the readings inside requests. None when fewer than three readings
/// with distinct token counts, or when live bytes do not rise with tokens.
pub fn fit(tl: &Timeline) -> Option<TokenFit> {
    let active: Vec<&Point> = tl.active().collect();
    let pts: Vec<(f64, f64)> = active
        .iter()
        .map(|p| (p.active_tokens as f64, p.allocated as f64))
        .collect();
    let mut distinct: Vec<u64> = active.iter().map(|p| p.active_tokens).collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < MIN_FIT_POINTS {
        return None;
    }
    let mk = stats::mann_kendall(&thin(&pts, MAX_FIT_POINTS))?;
    if mk.p_increasing >= FIT_P_VALUE {
        return None;
    }
    // Slopes between readings at the same number of sequences measure bytes
    // per token alone; across sequence counts, per-sequence bytes leak in.
    let mut slopes = Vec::new();
    let mut levels: Vec<u64> = active.iter().map(|p| sequences(p)).collect();
    levels.sort_unstable();
    levels.dedup();
    for level in &levels {
        let group: Vec<(f64, f64)> = pts
            .iter()
            .zip(&active)
            .filter(|(_, p)| sequences(p) == *level)
            .map(|(pt, _)| *pt)
            .collect();
        // Bounded in all: the groups share the budget of one fit.
        let per_group = (MAX_FIT_POINTS / levels.len()).max(16);
        slopes.extend(stats::pairwise_slopes(&thin(&group, per_group)));
    }
    if slopes.len() < MIN_FIT_POINTS {
        slopes = stats::pairwise_slopes(&thin(&pts, MAX_FIT_POINTS));
    }
    let bytes_per_token = stats::median(&slopes)?;
    if bytes_per_token <= 0.0 {
        return None;
    }
    let q1 = stats::quantile(&slopes, 0.25)?;
    let q3 = stats::quantile(&slopes, 0.75)?;
    let spread = ((q3 - q1) / 2.0 / bytes_per_token).abs();

    // What tokens do not explain, against sequences: per-sequence live bytes
    // (slope) and fixed bytes (intercept).
    let residual: Vec<(f64, f64)> = active
        .iter()
        .map(|p| {
            (
                sequences(p) as f64,
                p.allocated as f64 - bytes_per_token * p.active_tokens as f64,
            )
        })
        .collect();
    let line = if levels.len() >= 2 {
        stats::theil_sen(&thin(&residual, MAX_FIT_POINTS))?
    } else {
        Line {
            slope: 0.0,
            intercept: stats::median(&residual.iter().map(|r| r.1).collect::<Vec<_>>())?,
        }
    };
    let live_per_sequence = line.slope.max(0.0);
    let fixed_bytes = if line.slope >= 0.0 {
        line.intercept
    } else {
        stats::median(&residual.iter().map(|r| r.1).collect::<Vec<_>>())?
    };

    let transient_per_sequence = transients(tl).into_iter().fold(0.0, f64::max);
    let context_tokens = active
        .iter()
        .map(|p| p.active_tokens.div_ceil(sequences(p)))
        .max()
        .unwrap_or(0);
    let r2 = stats::least_squares(&pts).map_or(0.0, |(_, r2)| r2);
    Some(TokenFit {
        bytes_per_token,
        fixed_bytes: fixed_bytes.max(0.0),
        live_per_sequence,
        transient_per_sequence,
        context_tokens,
        max_tokens: distinct.last().copied().unwrap_or(0),
        max_sequences: levels.last().copied().unwrap_or(0),
        points: pts.len(),
        spread,
        p_value: mk.p_increasing,
        r2,
    })
}

/// Peak − live per sequence at each reading inside a request where the
/// (cumulative) peak rose since the reading before: only then was the peak
/// set by this request's own temporaries.
fn transients(tl: &Timeline) -> Vec<f64> {
    let device: Vec<&Point> = tl.device().collect();
    device
        .windows(2)
        .filter(|w| w[1].peak > w[0].peak && w[1].active_tokens > 0 && !w[1].is_load())
        .map(|w| w[1].peak.saturating_sub(w[1].allocated) as f64 / sequences(w[1]) as f64)
        .collect()
}
