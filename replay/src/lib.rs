//! Agent streams that no live agent sends, put on a collector: recorded ones
//! read back from capture files ([`capture`]) and replayed through the
//! agent's reporter ([`driver`], `oomscope replay`), and synthetic load of
//! real-size samples for sizing a collector ([`ingest_load`], `oomscope bench
//! ingest`). Agents never link this crate (nor flate2 for gzipped captures).

pub mod capture;
pub mod driver;
pub mod ingest_load;
