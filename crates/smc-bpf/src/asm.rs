//! A tiny, typed eBPF instruction encoder with labels.
//!
//! Only the instruction forms the rendezvous program needs are provided. Encoding follows the
//! eBPF ISA (`struct bpf_insn`: `u8 code; u8 dst_reg:4, src_reg:4; s16 off; s32 imm`), in the
//! host's byte order, because the kernel reads instructions as native C structs.
//!
//! Jumps refer to [`Label`]s; [`Asm::finish`] resolves them to relative offsets
//! (`target - (jump + 1)`, in instruction slots) and refuses unbound labels, labels bound twice
//! and offsets that do not fit the 16-bit field. A 64-bit immediate load (`ld_imm64`) takes two
//! slots, which the resolver accounts for.

#![forbid(unsafe_code)]

use std::fmt;

/// An eBPF register. `R10` is the read-only frame pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Reg {
    R0 = 0,
    R1 = 1,
    R2 = 2,
    R3 = 3,
    R4 = 4,
    R5 = 5,
    R6 = 6,
    R7 = 7,
    R8 = 8,
    R9 = 9,
    R10 = 10,
}

/// Memory access width of a load or store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    /// 1 byte (`BPF_B`).
    B,
    /// 2 bytes (`BPF_H`).
    H,
    /// 4 bytes (`BPF_W`).
    W,
    /// 8 bytes (`BPF_DW`).
    DW,
}

impl Size {
    const fn bits(self) -> u8 {
        match self {
            Size::W => 0x00,
            Size::H => 0x08,
            Size::B => 0x10,
            Size::DW => 0x18,
        }
    }
}

/// Arithmetic operation of the 64-bit ALU class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alu {
    Add,
    Sub,
    Or,
    And,
    Lsh,
    Mov,
}

impl Alu {
    const fn bits(self) -> u8 {
        match self {
            Alu::Add => 0x00,
            Alu::Sub => 0x10,
            Alu::Or => 0x40,
            Alu::And => 0x50,
            Alu::Lsh => 0x60,
            Alu::Mov => 0xb0,
        }
    }
}

/// Condition of a conditional jump (64-bit compare).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cond {
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// unsigned `>`
    Gt,
    /// `& != 0`
    Set,
}

impl Cond {
    const fn bits(self) -> u8 {
        match self {
            Cond::Eq => 0x10,
            Cond::Gt => 0x20,
            Cond::Set => 0x40,
            Cond::Ne => 0x50,
        }
    }
}

// Instruction classes and modes (eBPF ISA).
const CLASS_LD: u8 = 0x00;
const CLASS_LDX: u8 = 0x01;
const CLASS_ST: u8 = 0x02;
const CLASS_STX: u8 = 0x03;
const CLASS_JMP: u8 = 0x05;
const CLASS_ALU64: u8 = 0x07;
const MODE_IMM: u8 = 0x00;
const MODE_MEM: u8 = 0x60;
const SRC_K: u8 = 0x00;
const SRC_X: u8 = 0x08;
const JMP_JA: u8 = 0x00;
const JMP_CALL: u8 = 0x80;
const JMP_EXIT: u8 = 0x90;

/// `src_reg` value of an `ld_imm64` whose immediate is a map file descriptor
/// (`BPF_PSEUDO_MAP_FD`).
pub const PSEUDO_MAP_FD: u8 = 1;

/// One 8-byte instruction slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Insn {
    pub code: u8,
    pub dst: u8,
    pub src: u8,
    pub off: i16,
    pub imm: i32,
}

impl Insn {
    /// The 8 bytes the kernel expects for this slot (host byte order; the register nibbles are
    /// packed as the C bit-field `dst_reg:4, src_reg:4` is on this target).
    pub fn encode(&self) -> [u8; 8] {
        let regs = if cfg!(target_endian = "little") {
            (self.src << 4) | (self.dst & 0x0f)
        } else {
            (self.dst << 4) | (self.src & 0x0f)
        };
        let off = self.off.to_ne_bytes();
        let imm = self.imm.to_ne_bytes();
        [
            self.code, regs, off[0], off[1], imm[0], imm[1], imm[2], imm[3],
        ]
    }
}

/// Encodes a whole instruction stream.
pub fn encode_all(insns: &[Insn]) -> Vec<u8> {
    insns.iter().flat_map(|i| i.encode()).collect()
}

/// A jump target, created by [`Asm::new_label`] and bound by [`Asm::bind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Label(usize);

/// Why an instruction stream could not be finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AsmError {
    /// A jump refers to a label that was never bound.
    UnboundLabel(usize),
    /// `bind` was called twice for the same label.
    LabelBoundTwice(usize),
    /// The relative offset does not fit the 16-bit `off` field.
    JumpTooFar { at: usize, offset: i64 },
}

impl fmt::Display for AsmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AsmError::UnboundLabel(l) => write!(f, "jump to label {l} which is never bound"),
            AsmError::LabelBoundTwice(l) => write!(f, "label {l} bound twice"),
            AsmError::JumpTooFar { at, offset } => {
                write!(f, "jump at slot {at} needs offset {offset}, outside i16")
            }
        }
    }
}

impl std::error::Error for AsmError {}

/// Instruction stream under construction.
#[derive(Debug, Default)]
pub struct Asm {
    insns: Vec<Insn>,
    /// Slot index each label is bound to.
    labels: Vec<Option<usize>>,
    /// (slot of the jump instruction, label) pairs to patch in `finish`.
    fixups: Vec<(usize, Label)>,
    first_error: Option<AsmError>,
}

impl Asm {
    pub fn new() -> Asm {
        Asm::default()
    }

    /// Number of slots emitted so far (`ld_imm64` counts as two).
    pub fn len(&self) -> usize {
        self.insns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.insns.is_empty()
    }

    /// A fresh, unbound label.
    pub fn new_label(&mut self) -> Label {
        self.labels.push(None);
        Label(self.labels.len() - 1)
    }

    /// Binds `label` to the next instruction emitted.
    pub fn bind(&mut self, label: Label) {
        let here = self.insns.len();
        match self.labels.get_mut(label.0) {
            Some(slot @ None) => *slot = Some(here),
            _ => {
                if self.first_error.is_none() {
                    self.first_error = Some(AsmError::LabelBoundTwice(label.0));
                }
            }
        }
    }

    fn push(&mut self, code: u8, dst: Reg, src: Reg, off: i16, imm: i32) -> &mut Self {
        self.insns.push(Insn {
            code,
            dst: dst as u8,
            src: src as u8,
            off,
            imm,
        });
        self
    }

    /// `dst = imm` (64-bit, imm sign-extended).
    pub fn mov64_imm(&mut self, dst: Reg, imm: i32) -> &mut Self {
        self.alu64_imm(Alu::Mov, dst, imm)
    }

    /// `dst = src` (64-bit).
    pub fn mov64_reg(&mut self, dst: Reg, src: Reg) -> &mut Self {
        self.alu64_reg(Alu::Mov, dst, src)
    }

    /// `dst op= imm` (64-bit, imm sign-extended).
    pub fn alu64_imm(&mut self, op: Alu, dst: Reg, imm: i32) -> &mut Self {
        self.push(CLASS_ALU64 | op.bits() | SRC_K, dst, Reg::R0, 0, imm)
    }

    /// `dst op= src` (64-bit).
    pub fn alu64_reg(&mut self, op: Alu, dst: Reg, src: Reg) -> &mut Self {
        self.push(CLASS_ALU64 | op.bits() | SRC_X, dst, src, 0, 0)
    }

    /// `dst = *(size *)(src + off)`
    pub fn ldx(&mut self, size: Size, dst: Reg, src: Reg, off: i16) -> &mut Self {
        self.push(CLASS_LDX | size.bits() | MODE_MEM, dst, src, off, 0)
    }

    /// `*(size *)(dst + off) = src`
    pub fn stx(&mut self, size: Size, dst: Reg, off: i16, src: Reg) -> &mut Self {
        self.push(CLASS_STX | size.bits() | MODE_MEM, dst, src, off, 0)
    }

    /// `*(size *)(dst + off) = imm`
    pub fn st_imm(&mut self, size: Size, dst: Reg, off: i16, imm: i32) -> &mut Self {
        self.push(CLASS_ST | size.bits() | MODE_MEM, dst, Reg::R0, off, imm)
    }

    /// `dst = imm64` (two slots).
    pub fn ld_imm64(&mut self, dst: Reg, imm: u64) -> &mut Self {
        self.ld_imm64_raw(dst, 0, imm)
    }

    /// `dst = map` where `map_fd` is a map file descriptor the kernel replaces by the map
    /// pointer at load time (two slots, `src_reg = BPF_PSEUDO_MAP_FD`).
    pub fn ld_map_fd(&mut self, dst: Reg, map_fd: i32) -> &mut Self {
        // The fd goes into the low 32 bits; `as u32` keeps its bit pattern.
        self.ld_imm64_raw(dst, PSEUDO_MAP_FD, u64::from(map_fd as u32))
    }

    fn ld_imm64_raw(&mut self, dst: Reg, src: u8, imm: u64) -> &mut Self {
        let lo = (imm & 0xffff_ffff) as u32 as i32;
        let hi = (imm >> 32) as u32 as i32;
        self.insns.push(Insn {
            code: CLASS_LD | Size::DW.bits() | MODE_IMM,
            dst: dst as u8,
            src,
            off: 0,
            imm: lo,
        });
        self.insns.push(Insn {
            code: 0,
            dst: 0,
            src: 0,
            off: 0,
            imm: hi,
        });
        self
    }

    /// Unconditional jump.
    pub fn ja(&mut self, target: Label) -> &mut Self {
        self.fixups.push((self.insns.len(), target));
        self.push(CLASS_JMP | JMP_JA, Reg::R0, Reg::R0, 0, 0)
    }

    /// `if dst <cond> imm goto target` (64-bit compare, imm sign-extended).
    pub fn jmp_imm(&mut self, cond: Cond, dst: Reg, imm: i32, target: Label) -> &mut Self {
        self.fixups.push((self.insns.len(), target));
        self.push(CLASS_JMP | cond.bits() | SRC_K, dst, Reg::R0, 0, imm)
    }

    /// `if dst <cond> src goto target` (64-bit compare).
    pub fn jmp_reg(&mut self, cond: Cond, dst: Reg, src: Reg, target: Label) -> &mut Self {
        self.fixups.push((self.insns.len(), target));
        self.push(CLASS_JMP | cond.bits() | SRC_X, dst, src, 0, 0)
    }

    /// Calls kernel helper number `helper`. Clobbers R1–R5, result in R0.
    pub fn call(&mut self, helper: i32) -> &mut Self {
        self.push(CLASS_JMP | JMP_CALL, Reg::R0, Reg::R0, 0, helper)
    }

    /// Returns R0.
    pub fn exit(&mut self) -> &mut Self {
        self.push(CLASS_JMP | JMP_EXIT, Reg::R0, Reg::R0, 0, 0)
    }

    /// Resolves every jump and returns the finished instruction stream.
    pub fn finish(mut self) -> Result<Vec<Insn>, AsmError> {
        if let Some(e) = self.first_error.take() {
            return Err(e);
        }
        for &(at, label) in &self.fixups {
            let target = self
                .labels
                .get(label.0)
                .copied()
                .flatten()
                .ok_or(AsmError::UnboundLabel(label.0))?;
            let offset = target as i64 - (at as i64 + 1);
            let off = i16::try_from(offset).map_err(|_| AsmError::JumpTooFar { at, offset })?;
            if let Some(insn) = self.insns.get_mut(at) {
                insn.off = off;
            }
        }
        Ok(self.insns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(f: impl FnOnce(&mut Asm)) -> [u8; 8] {
        let mut a = Asm::new();
        f(&mut a);
        let insns = a.finish().unwrap();
        assert_eq!(insns.len(), 1);
        insns[0].encode()
    }

    // Golden encodings, checked by hand against the ISA (opcode byte, regs byte with dst in the
    // low nibble on little-endian, off, imm).
    #[cfg(target_endian = "little")]
    #[test]
    fn golden_single_instructions() {
        assert_eq!(
            one(|a| {
                a.mov64_imm(Reg::R0, 1);
            }),
            [0xb7, 0x00, 0, 0, 1, 0, 0, 0]
        );
        assert_eq!(
            one(|a| {
                a.mov64_reg(Reg::R6, Reg::R1);
            }),
            [0xbf, 0x16, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            one(|a| {
                a.exit();
            }),
            [0x95, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            one(|a| {
                a.call(46);
            }),
            [0x85, 0, 0, 0, 46, 0, 0, 0]
        );
        assert_eq!(
            one(|a| {
                a.ldx(Size::W, Reg::R2, Reg::R6, 84);
            }),
            [0x61, 0x62, 84, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            one(|a| {
                a.stx(Size::DW, Reg::R10, -8, Reg::R0);
            }),
            [0x7b, 0x0a, 0xf8, 0xff, 0, 0, 0, 0]
        );
        assert_eq!(
            one(|a| {
                a.st_imm(Size::W, Reg::R10, -24, 0x1234_5678);
            }),
            [0x62, 0x0a, 0xe8, 0xff, 0x78, 0x56, 0x34, 0x12]
        );
        assert_eq!(
            one(|a| {
                a.st_imm(Size::H, Reg::R10, -20, 0x00ff);
            }),
            [0x6a, 0x0a, 0xec, 0xff, 0xff, 0, 0, 0]
        );
        assert_eq!(
            one(|a| {
                a.alu64_imm(Alu::And, Reg::R1, -65);
            }),
            [0x57, 0x01, 0, 0, 0xbf, 0xff, 0xff, 0xff]
        );
        assert_eq!(
            one(|a| {
                a.alu64_imm(Alu::Or, Reg::R7, 4);
            }),
            [0x47, 0x07, 0, 0, 4, 0, 0, 0]
        );
        assert_eq!(
            one(|a| {
                a.alu64_imm(Alu::Add, Reg::R2, -8);
            }),
            [0x07, 0x02, 0, 0, 0xf8, 0xff, 0xff, 0xff]
        );
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn golden_ld_map_fd_takes_two_slots() {
        let mut a = Asm::new();
        a.ld_map_fd(Reg::R1, 7);
        let insns = a.finish().unwrap();
        assert_eq!(
            encode_all(&insns),
            vec![0x18, 0x11, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        let mut a = Asm::new();
        a.ld_imm64(Reg::R3, 0x1122_3344_5566_7788);
        assert_eq!(
            encode_all(&a.finish().unwrap()),
            vec![0x18, 0x03, 0, 0, 0x88, 0x77, 0x66, 0x55, 0, 0, 0, 0, 0x44, 0x33, 0x22, 0x11]
        );
    }

    #[test]
    fn forward_and_backward_jumps_resolve() {
        let mut a = Asm::new();
        let fwd = a.new_label();
        let back = a.new_label();
        a.bind(back); // slot 0
        a.mov64_imm(Reg::R0, 0); // 0
        a.jmp_imm(Cond::Eq, Reg::R0, 3, fwd); // 1
        a.ld_imm64(Reg::R1, 5); // 2,3
        a.ja(back); // 4
        a.bind(fwd);
        a.exit(); // 5
        let insns = a.finish().unwrap();
        assert_eq!(insns[1].code, 0x15);
        assert_eq!(
            insns[1].off,
            5 - 2,
            "forward jump skips the two-slot ld_imm64 and the ja"
        );
        assert_eq!(insns[4].code, 0x05);
        assert_eq!(insns[4].off, -5, "backward jump to slot 0");
    }

    #[test]
    fn unbound_and_double_bound_labels_are_errors() {
        let mut a = Asm::new();
        let l = a.new_label();
        a.ja(l);
        assert_eq!(a.finish(), Err(AsmError::UnboundLabel(0)));

        let mut a = Asm::new();
        let l = a.new_label();
        a.bind(l);
        a.exit();
        a.bind(l);
        assert_eq!(a.finish(), Err(AsmError::LabelBoundTwice(0)));
    }

    #[test]
    fn jump_out_of_i16_range_is_an_error() {
        let mut a = Asm::new();
        let l = a.new_label();
        a.ja(l);
        for _ in 0..40_000 {
            a.mov64_imm(Reg::R0, 0);
        }
        a.bind(l);
        a.exit();
        assert!(matches!(
            a.finish(),
            Err(AsmError::JumpTooFar {
                at: 0,
                offset: 40_000
            })
        ));
    }
}
