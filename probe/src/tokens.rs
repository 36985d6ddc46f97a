//! Prompts sized in tokens, each one distinct. Pure: no I/O.
//!
//! A server's context limit and KV pool count tokens, not words, and a
//! prefix cache answers a repeated prompt (or a shared start) for free. So
//! every prompt here starts with words that spell a per-run counter (no two
//! prompts of a run share their first block) and goes on with the same words
//! for every prompt of its size in a shuffled order: distinct prompts whose
//! token counts agree (random words would spread them by a percent or two,
//! enough to push some over a limit the rung sits just under). The word
//! count for a token target comes from a [`Calibration`] fitted to what the
//! server counted (its tokenizer, else `usage.prompt_tokens`), corrected
//! after every answer.

/// Common English words that nearly every BPE or SentencePiece vocabulary
/// holds as one token (with their leading space), so a word is close to a
/// token before any calibration.
pub const WORDS: [&str; 256] = [
    "the", "of", "and", "to", "in", "is", "was", "he", "for", "it", "with", "as", "his", "on",
    "be", "at", "by", "had", "are", "but", "from", "or", "have", "an", "they", "which", "one",
    "you", "were", "her", "all", "she", "there", "would", "their", "we", "him", "been", "has",
    "when", "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about",
    "into", "than", "them", "can", "only", "other", "new", "some", "could", "time", "these", "two",
    "may", "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man", "me",
    "even", "most", "made", "after", "also", "did", "many", "before", "must", "through", "back",
    "years", "where", "much", "your", "way", "well", "down", "should", "because", "each", "just",
    "those", "people", "how", "too", "little", "state", "good", "very", "make", "world", "still",
    "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being",
    "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great",
    "old", "year", "off", "come", "since", "against", "go", "came", "right", "used", "take",
    "three", "place", "small", "found", "house", "water", "light", "city", "road", "music",
    "paper", "river", "table", "stone", "green", "black", "white", "south", "north", "east",
    "west", "money", "night", "game", "line", "power", "war", "hand", "school", "family", "group",
    "number", "part", "point", "home", "week", "company", "system", "program", "question", "case",
    "fact", "area", "story", "book", "word", "business", "issue", "side", "kind", "head",
    "service", "friend", "father", "mother", "hour", "open", "child", "reason", "level", "office",
    "door", "health", "person", "art", "history", "party", "result", "change", "morning", "air",
    "name", "teacher", "force", "idea", "body", "face", "eye", "food", "market", "field", "sea",
    "tree", "fire", "land", "ship", "train", "car", "king", "law", "voice", "model", "data",
    "plan", "team", "rate", "age", "view", "class", "heart", "mind", "love", "truth", "peace",
    "energy", "space", "cost", "size", "test", "rule", "role", "risk", "step",
];

/// Without a calibration point yet, a word of [`WORDS`] counts as one token.
pub const DEFAULT_TOKENS_PER_WORD: f64 = 1.0;

/// Words at the start of each prompt that spell its number in the run
/// (base 256 over [`WORDS`]): 16.7 million prompts before one repeats.
pub const COUNTER_WORDS: usize = 3;

/// SplitMix64: small, seeded, and the same on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn word(&mut self) -> &'static str {
        WORDS[(self.next_u64() & 0xff) as usize]
    }
    /// Fisher-Yates.
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// The run's prompts: each distinct, optionally behind one shared prefix.
#[derive(Clone, Debug)]
pub struct Prompts {
    rng: Rng,
    /// The first counter value (from the seed), so two runs differ too.
    base: u64,
    sent: u64,
    shared: Vec<&'static str>,
    /// The run's order of [`WORDS`]: a prompt's filler is the first words
    /// of it (cycling), so prompts of one size hold the same words.
    order: Vec<&'static str>,
}

impl Prompts {
    pub fn new(seed: u64) -> Prompts {
        let mut rng = Rng::new(seed);
        let base = rng.next_u64() & 0xff_ffff;
        let mut order = WORDS.to_vec();
        rng.shuffle(&mut order);
        Prompts {
            rng,
            base,
            sent: 0,
            shared: Vec::new(),
            order,
        }
    }

    /// Every later prompt starts with the same `words` words (`--shared-prefix`):
    /// the cached case, measured on purpose.
    pub fn set_shared_prefix(&mut self, words: usize) {
        let mut rng = Rng::new(self.base ^ 0x5eed);
        self.shared = (0..words).map(|_| rng.word()).collect();
    }

    pub fn shared_prefix_words(&self) -> usize {
        self.shared.len()
    }

    /// How many prompts were made.
    pub fn made(&self) -> u64 {
        self.sent
    }

    /// A new prompt of `words` words (at least the counter's): the shared
    /// prefix if any, then the counter words, then the size's filler words
    /// in an order of its own.
    pub fn next(&mut self, words: usize) -> String {
        let n = (self.base + self.sent) & 0xff_ffff;
        self.sent += 1;
        let mut out: Vec<&str> = Vec::with_capacity(words.max(COUNTER_WORDS));
        out.extend(self.shared.iter().take(words.saturating_sub(COUNTER_WORDS)));
        for i in 0..COUNTER_WORDS {
            out.push(WORDS[((n >> (8 * i)) & 0xff) as usize]);
        }
        let mut filler: Vec<&str> = (0..words.saturating_sub(out.len()))
            .map(|i| self.order[i % self.order.len()])
            .collect();
        self.rng.shuffle(&mut filler);
        out.extend(filler);
        out.join(" ")
    }
}

/// Tokens as the server counts a prompt of `words` words: `overhead +
/// per_word * words`, fitted to what it counted (a chat template adds a
/// fixed overhead; the words' split varies a little by tokenizer).
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    points: Vec<(f64, f64)>,
}

impl Calibration {
    /// The server counted `tokens` for a prompt of `words` words.
    pub fn observe(&mut self, words: usize, tokens: u64) {
        if words > 0 && tokens > 0 {
            self.points.push((words as f64, tokens as f64));
        }
    }

    pub fn observed(&self) -> usize {
        self.points.len()
    }

    /// (overhead, tokens per word): least squares over the points once two
    /// word counts differ, else proportional through the one point, else
    /// [`DEFAULT_TOKENS_PER_WORD`].
    pub fn fit(&self) -> (f64, f64) {
        let n = self.points.len() as f64;
        if self.points.is_empty() {
            return (0.0, DEFAULT_TOKENS_PER_WORD);
        }
        let mx = self.points.iter().map(|p| p.0).sum::<f64>() / n;
        let my = self.points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = self.points.iter().map(|p| (p.0 - mx).powi(2)).sum();
        if sxx < 1e-9 {
            return (0.0, (my / mx).max(0.05));
        }
        let sxy: f64 = self.points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let slope = (sxy / sxx).max(0.05);
        let overhead = (my - slope * mx).max(0.0);
        (overhead, slope)
    }

    /// The words for a prompt the server will count as about `tokens` tokens.
    pub fn words_for(&self, tokens: u64) -> usize {
        let (a, b) = self.fit();
        (((tokens as f64 - a) / b).round().max(1.0)) as usize
    }

    /// The tokens the server is expected to count for `words` words.
    pub fn tokens_for(&self, words: usize) -> u64 {
        let (a, b) = self.fit();
        (a + b * words as f64).round().max(1.0) as u64
    }
}

/// The rungs of a doubling ramp from `start` to `limit`, the last one
/// exactly `limit` (a ramp that doubles past it would stop short of it).
pub fn doubling(start: u64, limit: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut x = start.max(1);
    while x < limit {
        out.push(x);
        x = x.saturating_mul(2);
    }
    out.push(limit.max(1));
    out.dedup();
    out
}

/// The next bisection point between a passing `pass` and a failing `fail`,
/// or None once the gap is within `tolerance` of `fail` (the figure is then
/// within that share of the true bound).
pub fn bisect(pass: u64, fail: u64, tolerance: f64) -> Option<u64> {
    if fail <= pass + 1 || (fail - pass) as f64 <= tolerance * fail as f64 {
        return None;
    }
    Some(pass + (fail - pass) / 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn the_words_are_distinct() {
        let set: HashSet<&str> = WORDS.into_iter().collect();
        assert_eq!(set.len(), WORDS.len());
    }

    #[test]
    fn prompts_are_distinct_and_sized_in_words() {
        let mut p = Prompts::new(7);
        let mut seen = HashSet::new();
        for words in [1, 3, 4, 64, 4, 4, 4] {
            for _ in 0..200 {
                let s = p.next(words);
                assert_eq!(s.split(' ').count(), words.max(COUNTER_WORDS));
                assert!(seen.insert(s), "a prompt repeated");
            }
        }
        // Two runs with other seeds start elsewhere.
        assert_ne!(Prompts::new(1).next(8), Prompts::new(2).next(8));
    }

    #[test]
    fn prompts_of_one_size_hold_the_same_words_so_they_count_alike() {
        let mut p = Prompts::new(9);
        let bag = |s: &str| {
            let mut w: Vec<String> = s
                .split(' ')
                .skip(COUNTER_WORDS)
                .map(str::to_string)
                .collect();
            w.sort();
            w
        };
        let (a, b) = (p.next(700), p.next(700));
        assert_ne!(a, b);
        assert_eq!(bag(&a), bag(&b));
    }

    #[test]
    fn no_two_prompts_share_their_first_words_unless_a_prefix_is_asked_for() {
        let mut p = Prompts::new(3);
        let firsts: HashSet<String> = (0..1000)
            .map(|_| {
                p.next(32)
                    .split(' ')
                    .take(COUNTER_WORDS)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        assert_eq!(firsts.len(), 1000);
        p.set_shared_prefix(10);
        let a = p.next(32);
        let b = p.next(32);
        assert_ne!(a, b);
        let pa: Vec<&str> = a.split(' ').take(10).collect();
        let pb: Vec<&str> = b.split(' ').take(10).collect();
        assert_eq!(pa, pb, "the shared prefix is shared");
    }

    #[test]
    fn calibration_learns_overhead_and_rate() {
        let mut c = Calibration::default();
        assert_eq!(c.words_for(100), 100);
        // One point: proportional.
        c.observe(10, 13);
        assert_eq!(c.words_for(130), 100);
        // A chat template's 12 tokens and 1.25 tokens a word.
        let mut c = Calibration::default();
        for w in [4usize, 64, 256, 1024] {
            c.observe(w, 12 + (1.25 * w as f64) as u64);
        }
        let (a, b) = c.fit();
        assert!((a - 12.0).abs() < 1.0 && (b - 1.25).abs() < 0.01, "{a} {b}");
        let w = c.words_for(4096);
        assert!((c.tokens_for(w) as i64 - 4096).abs() <= 2);
    }

    #[test]
    fn ramps_end_on_the_limit_and_bisection_stops_within_tolerance() {
        assert_eq!(doubling(64, 512), [64, 128, 256, 512]);
        assert_eq!(
            doubling(64, 4096 - 16),
            [64, 128, 256, 512, 1024, 2048, 4080]
        );
        assert_eq!(doubling(64, 64), [64]);
        // Bisect 2048..4096 toward a bound of 3000.
        let (mut pass, mut fail) = (2048u64, 4096u64);
        let mut steps = 0;
        while let Some(mid) = bisect(pass, fail, 0.05) {
            if mid <= 3000 {
                pass = mid
            } else {
                fail = mid
            }
            steps += 1;
        }
        assert!(pass <= 3000 && pass as f64 >= 0.95 * 3000.0, "{pass}");
        assert!(steps <= 6, "{steps}");
    }
}
