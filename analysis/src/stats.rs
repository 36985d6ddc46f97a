//! Pure statistics for timelines: robust slopes, a trend test, least squares.
//!
//! Allocator timelines are step-shaped and carry outliers (a request's
//! temporaries caught by a sample), so slopes are Theil–Sen (the median of
//! pairwise slopes) and trends are judged by Mann–Kendall, which looks only at
//! the order of values.

/// The median; None for an empty slice. NaNs are ignored.
pub fn median(values: &[f64]) -> Option<f64> {
    quantile(values, 0.5)
}

/// The median of values each counted `weight` times.
pub fn weighted_median(mut values: Vec<(f64, u64)>) -> Option<f64> {
    values.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: u64 = values.iter().map(|v| v.1).sum();
    let mut seen = 0;
    values.into_iter().find_map(|(v, w)| {
        seen += w;
        (2 * seen >= total).then_some(v)
    })
}

/// The q-quantile (0..=1) by linear interpolation between order statistics.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    Some(v[lo] + (v[hi] - v[lo]) * (pos - lo as f64))
}

/// Slopes of every pair of points with distinct x.
pub fn pairwise_slopes(points: &[(f64, f64)]) -> Vec<f64> {
    let mut slopes = Vec::with_capacity(points.len() * points.len().saturating_sub(1) / 2);
    for (i, a) in points.iter().enumerate() {
        for b in &points[i + 1..] {
            let dx = b.0 - a.0;
            if dx != 0.0 {
                slopes.push((b.1 - a.1) / dx);
            }
        }
    }
    slopes
}

/// A fitted line `y = intercept + slope * x`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Line {
    pub slope: f64,
    pub intercept: f64,
}

impl Line {
    pub fn at(&self, x: f64) -> f64 {
        self.intercept + self.slope * x
    }
}

/// Theil–Sen: the median pairwise slope, and the median of `y - slope * x` as
/// the intercept. Needs two distinct x values.
pub fn theil_sen(points: &[(f64, f64)]) -> Option<Line> {
    let slope = median(&pairwise_slopes(points))?;
    let intercept = median(
        &points
            .iter()
            .map(|(x, y)| y - slope * x)
            .collect::<Vec<_>>(),
    )?;
    Some(Line { slope, intercept })
}

/// Ordinary least squares with its coefficient of determination (R²; 1 when
/// the y values do not vary at all). Needs two distinct x values.
pub fn least_squares(points: &[(f64, f64)]) -> Option<(Line, f64)> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let syy: f64 = points.iter().map(|p| (p.1 - my).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    let line = Line {
        slope,
        intercept: my - slope * mx,
    };
    let r2 = if syy == 0.0 {
        1.0
    } else {
        (sxy * sxy / (sxx * syy)).clamp(0.0, 1.0)
    };
    Some((line, r2))
}

/// Mann–Kendall trend test of y against x (pairs ordered by x; pairs with
/// equal x are not compared).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MannKendall {
    /// Concordant minus discordant pairs.
    pub s: f64,
    /// Kendall's tau-a: `s` over the number of compared pairs.
    pub tau: f64,
    /// The normal approximation's z score, with continuity correction.
    pub z: f64,
    /// One-sided p-value for an upward trend.
    pub p_increasing: f64,
}

/// Mann–Kendall with the variance corrected for tied y values. None with
/// fewer than three points.
pub fn mann_kendall(points: &[(f64, f64)]) -> Option<MannKendall> {
    if points.len() < 3 {
        return None;
    }
    let mut s = 0.0;
    let mut compared = 0.0;
    for (i, a) in points.iter().enumerate() {
        for b in &points[i + 1..] {
            let dx = b.0 - a.0;
            if dx == 0.0 {
                continue;
            }
            compared += 1.0;
            let dy = (b.1 - a.1) * dx.signum();
            if dy > 0.0 {
                s += 1.0;
            } else if dy < 0.0 {
                s -= 1.0;
            }
        }
    }
    let n = points.len() as f64;
    let mut ys: Vec<f64> = points.iter().map(|p| p.1).collect();
    ys.sort_by(f64::total_cmp);
    let mut ties = 0.0;
    let mut run = 1.0;
    for w in ys.windows(2) {
        if w[0] == w[1] {
            run += 1.0;
        } else {
            ties += run * (run - 1.0) * (2.0 * run + 5.0);
            run = 1.0;
        }
    }
    ties += run * (run - 1.0) * (2.0 * run + 5.0);
    let var = (n * (n - 1.0) * (2.0 * n + 5.0) - ties) / 18.0;
    let z = if var <= 0.0 {
        0.0
    } else if s > 0.0 {
        (s - 1.0) / var.sqrt()
    } else if s < 0.0 {
        (s + 1.0) / var.sqrt()
    } else {
        0.0
    };
    Some(MannKendall {
        s,
        tau: if compared > 0.0 { s / compared } else { 0.0 },
        z,
        p_increasing: normal_sf(z),
    })
}

/// P(Z > z) for a standard normal Z (Abramowitz & Stegun 7.1.26 on erfc,
/// absolute error below 1.5e-7: enough for significance levels).
pub fn normal_sf(z: f64) -> f64 {
    if z.is_nan() {
        return 1.0;
    }
    let x = z.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erfc = poly * (-x * x).exp();
    if z >= 0.0 {
        0.5 * erfc
    } else {
        1.0 - 0.5 * erfc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn theil_sen_ignores_an_outlier() {
        let mut pts: Vec<(f64, f64)> = (0..20).map(|i| (i as f64, 3.0 * i as f64 + 7.0)).collect();
        pts[10].1 = 1e9;
        let l = theil_sen(&pts).unwrap();
        assert!((l.slope - 3.0).abs() < 1e-9, "{l:?}");
        assert!((l.intercept - 7.0).abs() < 1e-9, "{l:?}");
        let (ols, _) = least_squares(&pts).unwrap();
        assert!(ols.slope > 100.0, "least squares is pulled by the outlier");
    }

    #[test]
    fn mann_kendall_separates_trend_from_flat() {
        let up: Vec<(f64, f64)> = (0..30).map(|i| (i as f64, i as f64)).collect();
        let mk = mann_kendall(&up).unwrap();
        assert_eq!(mk.tau, 1.0);
        assert!(mk.p_increasing < 1e-6);
        let flat: Vec<(f64, f64)> = (0..30).map(|i| (i as f64, 5.0)).collect();
        let mk = mann_kendall(&flat).unwrap();
        assert_eq!(mk.s, 0.0);
        assert!((mk.p_increasing - 0.5).abs() < 1e-6);
        assert!(mann_kendall(&up[..2]).is_none());
    }

    #[test]
    fn normal_tail_matches_tables() {
        assert!((normal_sf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_sf(1.959_964) - 0.025).abs() < 1e-6);
        assert!((normal_sf(3.090_232) - 0.001).abs() < 1e-6);
        assert!((normal_sf(-1.644_854) - 0.95).abs() < 1e-6);
    }

    #[test]
    fn quantiles_interpolate() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[1.0, 2.0, 3.0, 4.0]), Some(2.5));
        assert_eq!(quantile(&[0.0, 10.0], 0.25), Some(2.5));
        assert_eq!(median(&[]), None);
    }
}
