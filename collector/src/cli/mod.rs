//! Command-line verbs.

pub fn main() -> i32 {
    0
}
