fn main() {
    std::process::exit(oomscope_cli::main());
}
