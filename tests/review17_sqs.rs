//! Review 17: SqsConsumer findings. No failing test was written for the
//! consumer within the review's time (see the review report).
